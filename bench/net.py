"""Gang networking: what the direct path costs against the raw link and wireguard-go alone.

Two namespace hosts on one switch (tests/net/rig.py: veth pairs and a bridge), the same pair
for every arm, in one run:

- iperf3 (TCP, 5 s, 1 stream, median of 5 rounds that take every arm in turn) over the raw
  veth; over wireguard-go set up by hand with its defaults (MTU 1420: the strongest plain
  setting), and again at MTU 1280; over muster's direct-path device (muster.net.wireguard,
  keepalive 25 s, made as the agent makes it) at the two sizes muster picks: 1280 for hosts
  that declared no region (or several), 1420 for hosts in one declared provider region;
- a gloo all_reduce of 4 and 64 MiB between the two hosts (1 rank each, the median of at
  least 15 and at least 1.5 s of them, after a warm-up): torchrun by hand bound to the raw
  interface and to muster0, and the same script
  submitted as a muster job on the private path (real agents, the probe, the rendezvous
  port's nftables rule on node 0); the raw and private arms take 9 turns, all with the
  rig's controller and agents up (they share this machine's cores; on a cluster the
  controller runs elsewhere).

- muster's probe (muster.net.probe, the spec's default sample: at most 10 s, sooner once
  steady) over the raw veth and over muster direct, in the same rounds, against iperf3 on
  the same path (on the raw veth also against `iperf3 -Z`, whose sender copies nothing:
  a veth's rate is how fast the two ends copy); and a 4-member gang's whole probe, timed.

Goals (issue 10): muster direct >= 0.95x wireguard-go alone (in one region, both at 1420;
across regions muster keeps 1280 and is compared with wireguard-go at 1280 too); the probe
within +-15% of iperf3; a 4-member gang's probe done in <= 15 s; muster private >= 0.95x the
raw veth (as all_reduce time: raw / private >= 0.95).

    sudo .venv/bin/python bench/net.py
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from muster.gang.network import probe_rounds
from muster.plan import MESH_MTU, MESH_MTU_REGION
from tests.net.rig import Host, Rig, missing_tools, why_unavailable

PROBE_SECONDS = 10.0  # the spec's default probe_seconds (a steady link ends sooner)

ALL_REDUCE = textwrap.dedent(
    """
    import statistics, sys, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    # Steady state, in every arm alike: under muster each member's watchdog starts 5 s
    # after torchrun (a Python start-up, a second of CPU on this 2-core machine).
    time.sleep(8)
    for mib in (4, 64):
        t = torch.ones(mib * (1 << 20) // 4)
        dist.all_reduce(t)  # warm-up: connections, buffers
        # At least 15 and at least ~1.5 s of them: at 4 MiB (~3 ms each) 15 were 45 ms,
        # and a turn read whatever the machine did in those (0.5-1.2x between turns).
        # Rank 0 decides when to stop and says so, so both ranks run the same count.
        times, more = [], torch.ones(1)
        while more.item():
            t.fill_(1.0)  # (summed in place: doubling each time, it would reach inf)
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - start)
            more.fill_(float(len(times) < 15 or sum(times) < 1.5))
            dist.broadcast(more, 0)
        if dist.get_rank() == 0:
            print(f"allreduce {mib} {statistics.median(times):.6f}", flush=True)
    dist.destroy_process_group()
    """
)


def iperf3(
    rig: Rig, client: Host, server_addr: str, seconds: int = 5, zerocopy: bool = False
) -> float:
    """Gbit/s received, one TCP stream, 1 MiB writes (iperf3's largest; its default 128 KiB
    costs a CPU-bound veth a third of its rate here, and the probe writes 1 MiB too);
    ``zerocopy``: -Z, the sender hands the kernel pages (sendfile) instead of copying."""
    for _ in range(3):  # (iperf3's server takes one test at a time: "the server is busy")
        out = rig.run(
            client, "iperf3", "-c", server_addr, "-t", str(seconds), "-l", "1M",
            *(["-Z"] if zerocopy else []), "-J", timeout=seconds + 30, check=False,
        ).stdout  # fmt: skip
        result = json.loads(out)
        if "error" not in result:
            return float(result["end"]["sum_received"]["bits_per_second"]) / 1e9
        time.sleep(1)
    raise RuntimeError(f"iperf3 to {server_addr}: {result['error']}")


def gloo(
    rig: Rig, hosts: tuple[Host, Host], master: str, ifname: str, script: Path
) -> dict[int, float]:
    port = 29400 + int(time.time()) % 500
    procs = []
    for rank, host in enumerate(hosts):
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--node-rank", str(rank), "--master-addr", master, "--master-port", str(port),
            str(script),
        ]  # fmt: skip
        env = {"GLOO_SOCKET_IFNAME": ifname, "OMP_NUM_THREADS": "1"}
        procs.append(
            subprocess.Popen(
                host.argv(["env", *(f"{k}={v}" for k, v in env.items()), *cmd]),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = [p.communicate(timeout=300)[0] for p in procs]
    result = {}
    for line in outs[0].splitlines():
        if line.startswith("allreduce "):
            _, mib, seconds = line.split()
            result[int(mib)] = float(seconds)
    if len(result) != 2:
        raise RuntimeError(f"the all_reduce did not finish: {outs}")
    return result


def muster_private(rig: Rig, ctl: Host, work: Path, round_: int) -> dict[int, float]:
    """The all_reduce script as a muster job on the private path, through the real agents
    (the rig's controller and agents, started by the caller)."""
    job_dir = work / f"private-job-{round_}"
    job_dir.mkdir()
    (job_dir / "train.py").write_text(ALL_REDUCE)
    (job_dir / "job.yaml").write_text(
        "name: allreduce\nentrypoint: train.py\ntimeout: 5m\nenv: {OMP_NUM_THREADS: '1'}\n"
        "distributed: {num_workers: 2, procs_per_worker: 1, backend: gloo}\n"
    )
    job_id = rig.muster(ctl, "submit", str(job_dir / "job.yaml")).strip()
    # Asked every 2 s, not 0.5: a job's answer costs the controller ~6 ms of CPU, here on
    # the ranks' cores (on a cluster the controller is elsewhere; the raw arm has no poll).
    job = rig.wait_done(job_id, timeout=300, poll=2.0)
    if job["state"] != "succeeded" or job["path_class"] != "private":
        raise RuntimeError(f"the private job: {job['state']} on {job['path_class']}")
    result = {}
    for line in rig.api("logs", job_id)["lines"]:
        if line["origin"] == "rank" and line["text"].startswith("allreduce "):
            _, mib, seconds = line["text"].split()
            result[int(mib)] = float(seconds)
    if len(result) != 2:
        raise RuntimeError(f"the private job printed no timings: {job['events']}")
    return result


def wireguard_by_hand(
    rig: Rig, hosts: tuple[Host, Host], name: str, port: int, net: str, mtu: int | None
) -> None:
    """wireguard-go set up with wg as its README shows: device ``name`` on ``net``.1/.2,
    UDP ``port``; ``mtu`` None keeps wireguard-go's default (1420)."""
    keys = []
    for host in hosts:
        private = rig.run(host, "wg", "genkey").stdout.strip()
        public = subprocess.run(
            ["wg", "pubkey"], input=private, capture_output=True, text=True, check=True
        ).stdout.strip()
        keys.append((private, public))
    for i, host in enumerate(hosts):
        rig.run(host, "wireguard-go", name)
        deadline = time.monotonic() + 10
        while rig.run(host, "test", "-S", f"/run/wireguard/{name}.sock", check=False).returncode:
            assert time.monotonic() < deadline, "wireguard-go did not start"
            time.sleep(0.05)
        key_file = host.root / f"{name}.key"
        key_file.write_text(keys[i][0] + "\n")
        key_file.chmod(0o600)
        other = hosts[1 - i]
        rig.run(host, "wg", "set", name, "private-key", str(key_file), "listen-port", str(port),
                "peer", keys[1 - i][1], "endpoint", f"{other.address}:{port}",
                "allowed-ips", f"{net}.{2 - i}/32")  # fmt: skip
        rig.run(host, "ip", "address", "add", f"{net}.{i + 1}/24", "dev", name)
        if mtu is not None:
            rig.run(host, "ip", "link", "set", name, "mtu", str(mtu))
        rig.run(host, "ip", "link", "set", name, "up")


IPERF_ROUNDS = 5
GLOO_ROUNDS = 9  # turns of the raw and private arms: single turns swing 0.5-1.2x here


def muster_direct(
    rig: Rig, hosts: tuple[Host, Host], name: str, port: int, net: str, offered: int
) -> int:
    """muster's device on each host, made by muster.net.wireguard as the agent makes it: the
    gang's ``offered`` MTU (muster.plan.mesh_mtu) lowered to the host's uplink toward its peer
    (device_mtu, uplink_mtu). Returns the MTU the first host's device took."""
    code = textwrap.dedent(
        f"""
        import json, sys, time
        from muster.net.wireguard import Device, Peer, uplink_mtu
        from muster.plan import device_mtu
        d = Device({name!r})
        mtu = device_mtu({offered}, uplink_mtu(sys.argv[2]))
        d.up(sys.argv[1], 22, {port}, mtu)
        print(json.dumps({{"key": d.public_key, "mtu": mtu}}), flush=True)
        peer = json.loads(sys.stdin.readline())
        d.set_peers([Peer(peer["key"], peer["endpoint"], peer["address"])])
        print("up", flush=True)
        sys.stdin.readline()  # until the bench closes stdin
        d.down()
        """
    )
    procs = []
    for i, host in enumerate(hosts):
        procs.append(
            subprocess.Popen(
                host.argv([sys.executable, "-c", code, f"{net}.{i + 1}", hosts[1 - i].address]),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        )
    made = [json.loads(p.stdout.readline()) for p in procs]  # type: ignore[union-attr]
    keys = [m["key"] for m in made]
    for i, proc in enumerate(procs):
        other = hosts[1 - i]
        peer = {
            "key": keys[1 - i],
            "endpoint": f"{other.address}:{port}",
            "address": f"{net}.{2 - i}",
        }
        proc.stdin.write(json.dumps(peer) + "\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        assert proc.stdout.readline().strip() == "up"  # type: ignore[union-attr]
    rig.procs.extend(procs)  # type: ignore[arg-type]
    return int(made[0]["mtu"])


PROBE = textwrap.dedent(
    """
    import asyncio, json, sys
    from muster.net.probe import ProbeListener, probe_peers

    async def main():
        if sys.argv[1] == "listen":
            listener = ProbeListener()
            port = await listener.start(sys.argv[2])
            print(port, flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
            await listener.close()
        else:
            peers = json.loads(sys.argv[2])
            results = await probe_peers([tuple(p) for p in peers], float(sys.argv[3]), 120)
            print(json.dumps([r.as_json() for r in results]), flush=True)

    asyncio.run(main())
    """
)


def probe_listen(rig: Rig, host: Host, address: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        host.argv([sys.executable, "-c", PROBE, "listen", address]),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    port = int(proc.stdout.readline())  # type: ignore[union-attr]
    return proc, port


def probe_gbps(rig: Rig, a: Host, b: Host, address: str, seconds: float) -> float:
    """muster's probe from ``a`` to ``b`` at ``address``: its throughput sample."""
    listener, port = probe_listen(rig, b, address)
    try:
        out = rig.run(
            a, sys.executable, "-c", PROBE, "run", json.dumps([[1, address, port]]), str(seconds),
            timeout=120,
        ).stdout  # fmt: skip
    finally:
        listener.communicate("\n", timeout=10)
    result = json.loads(out)[0]
    if result["error"]:
        raise RuntimeError(result["error"])
    return float(result["gbps"])


def probe_gang_seconds(rig: Rig, hosts: list[Host], seconds: float) -> float:
    """A whole gang's probe as the controller runs it: every member listens, then the pairs
    are measured in rounds of disjoint pairs (muster.gang.network.probe_rounds), each round
    once the last is done. Wall seconds from the first round to the end of the last."""
    listeners = [probe_listen(rig, h, h.address) for h in hosts]
    try:
        start = time.perf_counter()
        for pairs in probe_rounds(len(hosts)):
            runs = []
            for a, b in pairs:
                peer = json.dumps([[b, hosts[b].address, listeners[b][1]]])
                runs.append(
                    subprocess.Popen(
                        hosts[a].argv([sys.executable, "-c", PROBE, "run", peer, str(seconds)]),
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                )
            for run in runs:
                out, _ = run.communicate(timeout=300)
                if json.loads(out)[0]["error"]:
                    raise RuntimeError(out)
        return time.perf_counter() - start
    finally:
        for proc, _port in listeners:
            proc.communicate("\n", timeout=10)


def main() -> None:
    why = why_unavailable() or missing_tools("iperf3", "wg", "wireguard-go")
    if why:
        sys.exit(f"bench/net.py: {why}")
    with Rig() as rig, tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "allreduce.py"
        script.write_text(ALL_REDUCE)
        a, b = rig.one_region(2)
        for host in (a, b):
            rig.spawn(host, "iperf3", "iperf3", "-s")
        time.sleep(0.5)
        wireguard_by_hand(rig, (a, b), "wgbench", 51900, "10.99.0", None)
        wireguard_by_hand(rig, (a, b), "wg1280", 51902, "10.98.0", 1280)
        # Hosts that declared no region (or several): 1280. One declared provider region:
        # 1420, as each agent's device_mtu gives it over this rig's 1500-byte veths.
        muster_direct(rig, (a, b), "muster0", 51901, "100.64.0", MESH_MTU)
        region_mtu = muster_direct(rig, (a, b), "muster1", 51903, "100.64.4", MESH_MTU_REGION)
        for address in ("10.99.0.2", "100.64.0.2", "100.64.4.2"):  # the first handshakes
            assert any(rig.reaches(a, address, timeout=5) for _ in range(3)), address

        rows = {}
        arms = (
            ("raw veth", b.address),
            ("raw veth, iperf3 -Z", b.address),
            ("wireguard-go by hand", "10.99.0.2"),
            ("wireguard-go, MTU 1280", "10.98.0.2"),
            ("muster direct", "100.64.0.2"),
            ("muster direct, one region", "100.64.4.2"),
        )
        probes = (("probe, raw veth", b.address), ("probe, muster direct", "100.64.0.2"))
        # Interleaved (every arm once per round, the probe's samples too): this machine's
        # speed drifts over minutes, and a ratio of arms run minutes apart would measure it.
        runs: dict[str, list[float]] = {arm: [] for arm, _ in (*arms, *probes)}
        for turn in range(IPERF_ROUNDS):
            # Every other round in reverse order: an arm that always ran after another
            # would also carry the drift between them.
            for arm, addr in arms if turn % 2 == 0 else arms[::-1]:
                runs[arm].append(iperf3(rig, a, addr, zerocopy=arm.endswith("-Z")))
            for arm, addr in probes:
                runs[arm].append(probe_gbps(rig, a, b, addr, PROBE_SECONDS))
        for arm, _ in (*arms, *probes):
            rows[arm] = statistics.median(runs[arm])
            tool = "" if arm.startswith("probe") else "iperf3 "
            print(f"{tool}{arm:33} {rows[arm]:6.2f} Gbit/s (median of {IPERF_ROUNDS}: "
                  + ", ".join(f"{r:.2f}" for r in runs[arm]) + ")", flush=True)  # fmt: skip

        def paired(mine: str, theirs: str) -> str:
            """The median of the per-round ratios, and their range."""
            ratios = sorted(m / t for m, t in zip(runs[mine], runs[theirs], strict=True))
            return f"{statistics.median(ratios):.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})"

        ratio = rows["muster direct, one region"] / rows["wireguard-go by hand"]
        rounds = paired("muster direct, one region", "wireguard-go by hand")
        print(f"muster direct in one region (MTU {region_mtu}) / wireguard-go alone (1420): "
              f"{ratio:.2f}, per round {rounds} "
              f"(goal >= 0.95: {'met' if ratio >= 0.95 else 'NOT met'})")  # fmt: skip
        same = rows["muster direct"] / rows["wireguard-go, MTU 1280"]
        print(f"muster direct across regions (MTU 1280) / wireguard-go alone at 1280: {same:.2f}"
              f", per round {paired('muster direct', 'wireguard-go, MTU 1280')}")  # fmt: skip
        cost = rows["muster direct"] / rows["wireguard-go by hand"]
        print(f"muster direct across regions / wireguard-go alone (1420): {cost:.2f}")

        for probe, iperf in (("probe, raw veth", "raw veth"),
                             ("probe, raw veth", "raw veth, iperf3 -Z"),
                             ("probe, muster direct", "muster direct")):  # fmt: skip
            ratio = rows[probe] / rows[iperf]
            print(f"{probe} (<= {PROBE_SECONDS:.0f} s samples) / iperf3 {iperf}: {ratio:.2f}, "
                  f"per round {paired(probe, iperf)} (goal 0.85-1.15)")  # fmt: skip

        # The controller and the agents run on this machine's cores too (on a real cluster
        # the controller is elsewhere): every arm runs with them up, the private job and
        # torchrun by hand on the raw veth taking turns, GLOO_ROUNDS times.
        ctl = rig.start_cluster((a, b))
        direct = gloo(rig, (a, b), "100.64.0.1", "muster0", script)
        raw: list[dict[int, float]] = []
        private: list[dict[int, float]] = []
        for i in range(GLOO_ROUNDS):  # (which arm goes first alternates, as above)
            if i % 2:
                private.append(muster_private(rig, ctl, Path(tmp), i))
            raw.append(gloo(rig, (a, b), a.address, "eth0", script))
            if not i % 2:
                private.append(muster_private(rig, ctl, Path(tmp), i))
        for mib in (4, 64):
            raw_ms = statistics.median(r[mib] for r in raw) * 1e3
            private_ms = statistics.median(p[mib] for p in private) * 1e3
            print(f"gloo all_reduce {mib:2} MiB: raw veth {raw_ms:7.1f} ms, muster private "
                  f"{private_ms:7.1f} ms, muster direct {direct[mib] * 1e3:8.1f} ms "
                  f"(medians of {GLOO_ROUNDS} turns; direct once)")  # fmt: skip
            print(
                f"all_reduce {mib} MiB: muster direct takes {direct[mib] * 1e3 / raw_ms:.1f}x "
                "the raw veth"
            )
            speeds = sorted(r[mib] / p[mib] for r, p in zip(raw, private, strict=True))
            speed = statistics.median(speeds)
            print(f"all_reduce {mib} MiB: muster private runs at {speed:.2f}x the raw veth "
                  f"(per turn {', '.join(f'{s:.2f}' for s in speeds)}; goal >= 0.95: "
                  f"{'met' if speed >= 0.95 else 'NOT met'})")  # fmt: skip

    with Rig() as rig:
        hosts = rig.one_region(4)
        took = probe_gang_seconds(rig, hosts, PROBE_SECONDS)
        print(f"probe of a 4-member gang (<= {PROBE_SECONDS:.0f} s samples, 6 pairs): {took:.1f} s "
              f"(goal <= 15 s)")  # fmt: skip


if __name__ == "__main__":
    main()
