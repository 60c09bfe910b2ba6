// muster dashboard: fragment refresh, buttons, and the virtualised log view. No build step.
// Log text is untrusted: it only ever goes into the page as textContent, never as HTML.
"use strict";

const UI_HEADER = { "X-Muster-UI": "1" };  // what lets a session cookie change state

async function getText(url) {
  const r = await fetch(url, { credentials: "same-origin" });
  if (r.status === 401) { location.href = "/ui/login?next=" + encodeURIComponent(location.pathname); }
  if (!r.ok) throw new Error(url + ": HTTP " + r.status);
  return r.text();
}

async function apiError(r) {
  try {
    const body = await r.json();
    if (body.error) return body.error;
    if (Array.isArray(body.detail)) return body.detail.map((d) => (d.loc || []).join(".") + ": " + d.msg).join("; ");
    return body.detail || ("HTTP " + r.status);
  } catch (e) { return "HTTP " + r.status; }
}

// ---- fragments: <el data-refresh="/ui/..." data-every="ms"> ---------------------------------
const refreshers = new Map();
function refresh(el) {
  return getText(el.dataset.refresh).then((html) => { el.innerHTML = html; }).catch(() => {});
}
function startRefreshing() {
  for (const el of document.querySelectorAll("[data-refresh]")) {
    const every = Number(el.dataset.every || 2000);
    refreshers.set(el, setInterval(() => { if (!document.hidden) refresh(el); }, every));
  }
}

// A countdown the server rendered keeps ticking between refreshes.
setInterval(() => {
  for (const el of document.querySelectorAll(".countdown")) {
    const left = Math.max(0, Number(el.dataset.seconds) - 1);
    el.dataset.seconds = String(left);
    el.textContent = left.toFixed(0) + " s";
  }
}, 1000);

// ---- buttons: <button data-post="/v1/..." data-confirm="..."> --------------------------------
document.addEventListener("click", async (ev) => {
  const btn = ev.target.closest("button[data-post]");
  if (!btn) return;
  if (btn.dataset.confirm && !confirm(btn.dataset.confirm)) return;
  const status = document.getElementById("action-status");
  btn.disabled = true;
  const r = await fetch(btn.dataset.post, { method: "POST", credentials: "same-origin", headers: UI_HEADER });
  if (!r.ok && status) status.textContent = await apiError(r);
  const detail = document.getElementById("job-detail");
  if (detail) await refresh(detail);
});

// ---- the log view ------------------------------------------------------------------------------
// Holds at most MAX_HELD lines, fetched in pages from the server: the tail first, older pages
// as the reader scrolls up, newer ones while following. Only the rows on screen are in the DOM.
const ROW_H = 18, PAGE = 2000, MAX_HELD = 60000, POLL_MS = 1000, OVERSCAN = 30;

class LogView {
  constructor(section) {
    this.job = section.dataset.job;
    this.box = section.querySelector("#logview");
    this.spacer = this.box.querySelector(".spacer");
    this.rows = this.box.querySelector(".rows");
    this.status = section.querySelector("#log-status");
    this.follow = section.querySelector("#log-follow");
    this.form = section.querySelector("#log-filters");
    this.lines = [];      // [{tag, text, cls}]
    this.pages = [];      // [{prev, n}] in order: where each held page starts, and its size
    this.next = null;     // cursor after the newest held line (null: not known, reload first)
    this.filter = {};     // the filter applied (read from the form only on Apply)
    this.olderDone = false;
    this.busy = false;
    this.generation = 0;  // a reload abandons every fetch already on its way
    this.jobEnded = false;
    this.caughtUp = false;
    this.olderWanted = false;  // the reader reached the top while another fetch was out
    this.autoTarget = null;    // the scrollTop the view itself last set, to tell it from the reader's
    this.error = "";
    this.box.addEventListener("scroll", () => this.onScroll());
    this.form.addEventListener("submit", (ev) => { ev.preventDefault(); this.reload(); });
    this.follow.addEventListener("change", () => { if (this.follow.checked) this.reload(); });
    this.reload();
    setInterval(() => this.poll(), POLL_MS);
  }

  readFilter() {
    const f = {};
    const ranks = document.getElementById("log-ranks").value.trim();
    const node = document.getElementById("log-node").value.trim();
    const origin = document.getElementById("log-origin").value;
    if (ranks) f.ranks = ranks;
    if (node !== "") f.node = node;
    if (origin) f.origin = origin;
    return f;
  }

  query(extra) {
    const p = new URLSearchParams({ ...this.filter, ...extra });
    return "/v1/jobs/" + encodeURIComponent(this.job) + "/logs?" + p.toString();
  }

  // One page, or null when it failed (the error shows) or a reload made it stale.
  async fetchPage(extra, gen) {
    try {
      const r = await fetch(this.query(extra), { credentials: "same-origin" });
      if (gen !== this.generation) return null;
      if (r.status === 401) { location.href = "/ui/login?next=" + encodeURIComponent(location.pathname); return null; }
      if (!r.ok) { this.error = await apiError(r); this.showStatus(); return null; }
      const page = await r.json();
      if (gen !== this.generation) return null;
      this.error = "";
      this.jobEnded = ["succeeded", "failed", "cancelled"].includes(page.state);
      return page;
    } catch (e) {
      if (gen === this.generation) { this.error = "the controller did not answer (" + e.message + "); retrying"; this.showStatus(); }
      return null;
    }
  }

  convert(lines) {
    return lines.map((ln) => ({
      tag: ln.origin === "rank" ? "[rank " + ln.rank + "]" : "[node " + ln.rank + " torchrun]",
      text: ln.text,
      cls: "ln " + (ln.origin === "rank" ? "rank " : "node ") + ln.stream,
    }));
  }

  // Run ``work`` as the one fetch in flight of this generation. A wish for older lines that
  // meets another fetch (a follow poll) is kept and served when that one ends: the reader who
  // scrolled to the top makes no second scroll event to ask again.
  async exclusive(work) {
    if (this.busy) return;
    const gen = this.generation;
    this.busy = true;
    try { await work(gen); } finally {
      if (gen === this.generation) {
        this.busy = false;
        // (only if the reader is still at the top: an older page that was itself the fetch
        // out has moved the view down, and asks for nothing more)
        if (this.olderWanted) {
          this.olderWanted = false;
          if (this.box.scrollTop < 10 * ROW_H) this.older();
        }
      }
    }
  }

  async reload() {
    this.generation += 1;
    this.busy = false;
    this.filter = this.readFilter();
    this.lines = []; this.pages = []; this.next = null; this.olderDone = false; this.caughtUp = false;
    this.olderWanted = false;
    await this.exclusive(async (gen) => {
      const page = await this.fetchPage({ tail: "true", limit: String(PAGE) }, gen);
      if (!page) { this.render(false); return; }
      this.lines = this.convert(page.lines);
      this.pages = [{ prev: page.prev, n: page.lines.length }];
      this.olderDone = page.lines.length < PAGE;
      this.next = page.next;
      this.render(true);
    });
  }

  async poll() {
    if (!this.follow.checked || document.hidden) return;
    if (this.next === null) { if (!this.busy) this.reload(); return; }  // the tail never came
    if (this.jobEnded && this.caughtUp) return;
    await this.exclusive(async (gen) => {
      const page = await this.fetchPage({ after: this.next, limit: String(PAGE) }, gen);
      if (!page) return;
      this.caughtUp = page.lines.length === 0;
      if (page.lines.length >= PAGE) { setTimeout(() => this.reload(), 0); return; }  // far behind: to the tail
      if (!page.lines.length) { this.showStatus(); return; }
      this.lines.push(...this.convert(page.lines));
      this.pages.push({ prev: page.prev, n: page.lines.length });
      this.next = page.next;
      while (this.lines.length > MAX_HELD && this.pages.length > 1) {
        const first = this.pages.shift();
        this.lines.splice(0, first.n);
        this.olderDone = false;
      }
      this.render(true);
    });
  }

  async older() {
    if (this.olderDone || !this.pages.length || !this.pages[0].prev) return;
    if (this.busy) { this.olderWanted = true; return; }
    await this.exclusive(async (gen) => {
      const page = await this.fetchPage({ before: this.pages[0].prev, limit: String(PAGE) }, gen);
      if (!page) return;
      if (!page.lines.length) { this.olderDone = true; this.showStatus(); return; }
      this.lines.unshift(...this.convert(page.lines));
      this.pages.unshift({ prev: page.prev, n: page.lines.length });
      this.olderDone = page.lines.length < PAGE;
      // Grow the list first, then move down by what came in: the same lines stay on screen.
      this.spacer.style.height = this.lines.length * ROW_H + "px";
      this.box.scrollTop += page.lines.length * ROW_H;
      while (this.lines.length > MAX_HELD && this.pages.length > 1) {
        const last = this.pages.pop();
        this.lines.splice(this.lines.length - last.n, last.n);
        this.follow.checked = false;  // the newest lines are no longer held:
        this.next = null;             // following again starts from the tail
      }
      this.render(false);
    });
  }

  onScroll() {
    const atBottom = this.box.scrollTop + this.box.clientHeight >= this.box.scrollHeight - ROW_H;
    // Scroll events are coalesced: one that lands where the view put it is the view's own, one
    // elsewhere is the reader's even when the view moved too in the same frame.
    const own = this.autoTarget !== null && Math.abs(this.box.scrollTop - this.autoTarget) <= 1;
    this.autoTarget = null;
    if (!atBottom && this.follow.checked && !own) this.follow.checked = false;
    if (this.box.scrollTop < 10 * ROW_H) this.older();
    this.draw();
  }

  render(toBottom) {
    this.spacer.style.height = this.lines.length * ROW_H + "px";
    if (toBottom && this.follow.checked) {
      const target = this.box.scrollHeight - this.box.clientHeight;
      if (Math.abs(this.box.scrollTop - target) > 1) {
        this.box.scrollTop = target;
        this.autoTarget = this.box.scrollTop;  // the scroll event this makes is not the reader's
      }
    }
    this.draw();
    this.showStatus();
  }

  draw() {
    const first = Math.max(0, Math.floor(this.box.scrollTop / ROW_H) - OVERSCAN);
    const count = Math.ceil(this.box.clientHeight / ROW_H) + 2 * OVERSCAN;
    const last = Math.min(this.lines.length, first + count);
    const frag = document.createDocumentFragment();
    for (let i = first; i < last; i++) {
      const ln = this.lines[i];
      const row = document.createElement("div");
      row.className = ln.cls;
      const tag = document.createElement("span");
      tag.className = "tag";
      tag.textContent = ln.tag;
      row.append(tag, " " + ln.text);
      frag.append(row);
    }
    this.rows.style.top = first * ROW_H + "px";
    this.rows.replaceChildren(frag);
  }

  showStatus() {
    const parts = [this.lines.length.toLocaleString() + " lines held"];
    if (!this.olderDone && this.lines.length) parts.push("scroll up for older");
    parts.push(this.follow.checked ? (this.jobEnded ? "job ended" : "following") : "paused");
    this.status.textContent = this.error ? this.error : parts.join(" · ");
    this.status.classList.toggle("error", Boolean(this.error));
  }
}

document.addEventListener("DOMContentLoaded", () => {
  startRefreshing();
  const logs = document.getElementById("logs");
  if (logs) window.musterLogs = new LogView(logs);
});
