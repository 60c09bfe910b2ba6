"""``muster k8s ...``: the Kubernetes backend through Kubeflow Trainer (muster.k8s)."""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import replace
from pathlib import Path

import typer

from muster.cli.main import app, err, out, reports_errors
from muster.errors import FieldError, SpecError
from muster.k8s import fabric as fab
from muster.k8s.cluster import Check, Cluster, Preflight
from muster.k8s.fabric import FABRICS
from muster.k8s.render import TRAINER_VERSIONS, RenderOptions, render
from muster.k8s.rules import check
from muster.spec import load_job_file

k8s = typer.Typer(
    name="k8s",
    help="Run a job on Kubernetes through Kubeflow Trainer, wired to the cluster's fabric.",
    no_args_is_help=True,
)
app.add_typer(k8s)

FabricOpt = typer.Option("none", "--fabric", help=f"one of {', '.join(FABRICS)}")
VersionOpt = typer.Option("2.3", "--trainer-version", help="Kubeflow Trainer 2.2 or 2.3")
NamespaceOpt = typer.Option("default", "--namespace", "-n", help="namespace of the objects")


def _pairs(values: list[str], flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for value in values:
        key, sep, val = value.partition("=")
        if not sep or not key:
            raise SpecError([FieldError(flag, f"{value!r} is not key=value")], source=flag)
        out[key] = val
    return out


def _tolerations(values: list[str]) -> tuple[dict[str, str], ...]:
    """KEY[=VALUE][:EFFECT], as kubectl taint writes them; no value means operator Exists."""
    out = []
    for value in values:
        body, _, effect = value.partition(":")
        key, sep, val = body.partition("=")
        if not key:
            raise SpecError(
                [FieldError("--toleration", f"{value!r}: expected KEY[=VALUE][:EFFECT]")],
                source="--toleration",
            )
        item = {"key": key, "operator": "Equal" if sep else "Exists"}
        if sep:
            item["value"] = val
        if effect:
            item["effect"] = effect
        out.append(item)
    return tuple(out)


def options(
    fabric: str,
    trainer_version: str,
    namespace: str,
    runtime: str | None = None,
    gpu_nic_networks: str | None = None,
    efa_count: int | None = None,
    node_selector: list[str] | None = None,
    toleration: list[str] | None = None,
    nccl_env: str = "profile",
    nccl_debug: str | None = None,
    tcpxo_daemon_image: str | None = None,
    socket_ifname: str = "eth0",
) -> RenderOptions:
    errors = []
    if fabric not in FABRICS:
        errors.append(FieldError("--fabric", f"{fabric!r}: choose one of {', '.join(FABRICS)}"))
    if trainer_version not in TRAINER_VERSIONS:
        errors.append(FieldError("--trainer-version", f"{trainer_version!r}: choose 2.2 or 2.3"))
    if nccl_env not in ("inline", "profile"):
        errors.append(FieldError("--nccl-env", f"{nccl_env!r}: choose inline or profile"))
    if not re.fullmatch(r"[A-Za-z0-9_.:-]{1,15}", socket_ifname):
        errors.append(
            FieldError(
                "--socket-ifname",
                f"{socket_ifname!r} is not an interface name: give what `ip route get` names "
                "inside a pod (eth0 under the default CNI)",
            )
        )
    if errors:
        raise SpecError(errors, source="muster k8s")
    networks = tuple(n.strip() for n in (gpu_nic_networks or "").split(",") if n.strip())
    return RenderOptions(
        fabric=fabric,  # type: ignore[arg-type]
        trainer_version=trainer_version,  # type: ignore[arg-type]
        namespace=namespace,
        runtime=runtime,
        gpu_nic_networks=networks,
        efa_count=efa_count,
        node_selector=_pairs(node_selector or [], "--node-selector"),
        tolerations=_tolerations(toleration or []),
        nccl_env=nccl_env,  # type: ignore[arg-type]
        nccl_debug=nccl_debug,
        tcpxo_daemon_image=tcpxo_daemon_image or fab.TCPXO_DAEMON_IMAGE,
        socket_ifname=socket_ifname,
    )


RuntimeOpt = typer.Option(
    None, "--runtime", help="runtime name [tcpxo: JOB-tcpxo, written; else torch-distributed]"
)
NetworksOpt = typer.Option(
    None, "--gpu-nic-networks", help="tcpxo: the eight gpu-nic Network names, comma-separated"
)
EfaOpt = typer.Option(None, "--efa-count", help="efa: EFA devices per node")
SelectorOpt = typer.Option([], "--node-selector", help="KEY=VALUE (repeat)")
TolerationOpt = typer.Option([], "--toleration", help="KEY[=VALUE][:EFFECT] (repeat)")
NcclEnvOpt = typer.Option(
    "profile",
    "--nccl-env",
    help="tcpxo: source the NCCL plugin's own profile at start, or `inline` (muster's "
    f"transcription for plugin {fab.TCPXO_PLUGIN})",
)
IfnameOpt = typer.Option(
    "eth0",
    "--socket-ifname",
    help="efa/ib: the pod interface NCCL bootstraps on (what `ip route get` names in a pod)",
)
NcclDebugOpt = typer.Option(
    None, "--nccl-debug", help="set NCCL_DEBUG (INFO for a `muster verify-fabric` run)"
)
DaemonOpt = typer.Option(
    None, "--tcpxo-daemon-image", help="tcpxo: the daemon image paired with your NCCL plugin"
)
ContextOpt = typer.Option(None, "--context", help="kubeconfig context [default: current]")
ReplicatedJobOpt = typer.Option(
    "node", "--replicated-job", help="whose pods: node, or launcher under an MPI runtime"
)


def _warn(warnings: list[str]) -> None:
    for warning in warnings:
        err.print(f"[yellow]warning:[/] {warning}", markup=True, highlight=False)


@k8s.command("render")
@reports_errors
def render_cmd(
    job_file: Path = typer.Argument(..., help="the job's YAML file"),
    fabric: str = FabricOpt,
    trainer_version: str = VersionOpt,
    namespace: str = NamespaceOpt,
    runtime: str | None = RuntimeOpt,
    gpu_nic_networks: str | None = NetworksOpt,
    efa_count: int | None = EfaOpt,
    node_selector: list[str] = SelectorOpt,
    toleration: list[str] = TolerationOpt,
    nccl_env: str = NcclEnvOpt,
    nccl_debug: str | None = NcclDebugOpt,
    tcpxo_daemon_image: str | None = DaemonOpt,
    socket_ifname: str = IfnameOpt,
) -> None:
    """Print the Kubeflow Trainer objects for a job (a YAML stream for kubectl apply -f -)."""
    spec = load_job_file(job_file)
    opts = options(
        fabric,
        trainer_version,
        namespace,
        runtime,
        gpu_nic_networks,
        efa_count,
        node_selector,
        toleration,
        nccl_env,
        nccl_debug,
        tcpxo_daemon_image,
        socket_ifname,
    )
    rendered = render(spec, opts)
    _warn(rendered.warnings)
    typer.echo(rendered.to_yaml(), nl=False)


def _fill_from_cluster(opts: RenderOptions, report: Preflight) -> RenderOptions:
    """What the user left out and preflight read: the EFA count, the gpu-nic networks."""
    if opts.fabric == "efa" and opts.efa_count is None and report.efa_count:
        opts = replace(opts, efa_count=report.efa_count)
    if opts.fabric == "tcpxo" and not opts.gpu_nic_networks and report.networks:
        opts = replace(opts, gpu_nic_networks=tuple(report.networks))
    return opts


@k8s.command("preflight")
@reports_errors
def preflight_cmd(
    job_file: Path = typer.Argument(..., help="the job's YAML file"),
    fabric: str = FabricOpt,
    trainer_version: str = VersionOpt,
    namespace: str = NamespaceOpt,
    runtime: str | None = RuntimeOpt,
    gpu_nic_networks: str | None = NetworksOpt,
    node_selector: list[str] = SelectorOpt,
    toleration: list[str] = TolerationOpt,
    tcpxo_daemon_image: str | None = DaemonOpt,
    context: str | None = ContextOpt,
) -> None:
    """Read the cluster: EFA counts agree; for TCPXO the gpu-nic networks, 8-GPU nodes whose
    taints are tolerated, and the daemon paired with the installed plugin; the runtime."""
    spec = load_job_file(job_file)
    opts = options(
        fabric,
        trainer_version,
        namespace,
        runtime,
        gpu_nic_networks,
        None,
        node_selector,
        toleration,
        tcpxo_daemon_image=tcpxo_daemon_image,
    )
    cluster = Cluster.connect(namespace, context)
    report = cluster.preflight(opts)
    opts = _fill_from_cluster(opts, report)
    if report.ok:
        rendered = render(spec, opts)
        ref = rendered.objects[-1]["spec"]["runtimeRef"]
        target = (
            rendered.objects[0] if opts.fabric == "tcpxo" else cluster.get(ref["kind"], ref["name"])
        )
        if target is not None:
            check(rendered.objects[-1:], runtime=target, trainer_version=opts.trainer_version)
            report.checks.append(Check("patches", True, "every patch target is in the runtime"))
    for item in report.checks:
        mark = "[green]ok[/]  " if item.ok else "[red]FAIL[/]"
        out.print(f"{mark} {item.name}: ", end="", markup=True)
        out.print(item.detail, markup=False)
    if not report.ok:
        raise typer.Exit(1)
    out.print(f"render with: {shlex.join(_render_line(job_file, opts))}", markup=False)


def _render_line(job_file: Path, opts: RenderOptions) -> list[str]:
    """The `muster k8s render` command for these options, values read from the cluster included."""
    line = ["muster", "k8s", "render", str(job_file), "--fabric", opts.fabric]
    line += ["--trainer-version", opts.trainer_version, "--namespace", opts.namespace]
    if opts.runtime:
        line += ["--runtime", opts.runtime]
    if opts.efa_count is not None:
        line += ["--efa-count", str(opts.efa_count)]
    if opts.gpu_nic_networks:
        line += ["--gpu-nic-networks", ",".join(opts.gpu_nic_networks)]
    for key, value in opts.node_selector.items():
        line += ["--node-selector", f"{key}={value}"]
    for item in opts.tolerations:
        text = item["key"] + (f"={item['value']}" if "value" in item else "")
        line += ["--toleration", text + (f":{item['effect']}" if "effect" in item else "")]
    if opts.tcpxo_daemon_image != fab.TCPXO_DAEMON_IMAGE:
        line += ["--tcpxo-daemon-image", opts.tcpxo_daemon_image]
    return line


@k8s.command("apply")
@reports_errors
def apply_cmd(
    job_file: Path = typer.Argument(..., help="the job's YAML file"),
    fabric: str = FabricOpt,
    trainer_version: str = VersionOpt,
    namespace: str = NamespaceOpt,
    runtime: str | None = RuntimeOpt,
    gpu_nic_networks: str | None = NetworksOpt,
    efa_count: int | None = EfaOpt,
    node_selector: list[str] = SelectorOpt,
    toleration: list[str] = TolerationOpt,
    nccl_env: str = NcclEnvOpt,
    nccl_debug: str | None = NcclDebugOpt,
    tcpxo_daemon_image: str | None = DaemonOpt,
    socket_ifname: str = IfnameOpt,
    context: str | None = ContextOpt,
    dry_run: bool = typer.Option(
        False, "--dry-run", help="server-side dry run: show what would change, change nothing"
    ),
    yes: bool = typer.Option(
        False, "--yes", "-y", help="delete and recreate a TrainJob whose trainer changed"
    ),
) -> None:
    """Render and apply server-side (field manager muster); reads what is left out."""
    spec = load_job_file(job_file)
    opts = options(
        fabric,
        trainer_version,
        namespace,
        runtime,
        gpu_nic_networks,
        efa_count,
        node_selector,
        toleration,
        nccl_env,
        nccl_debug,
        tcpxo_daemon_image,
        socket_ifname,
    )
    cluster = Cluster.connect(namespace, context)
    if (fabric == "efa" and efa_count is None) or (fabric == "tcpxo" and not gpu_nic_networks):
        opts = _fill_from_cluster(opts, cluster.preflight(opts))
    rendered = render(spec, opts)
    _warn(rendered.warnings)

    def confirm(why: str) -> bool:
        if yes:
            return True
        if not sys.stdin.isatty():
            return False  # (refused with the reason and the --yes fix)
        return typer.confirm(f"{why}. Delete it and create it again?", default=False)

    for line in cluster.apply(
        rendered.objects, opts.trainer_version, dry_run=dry_run, confirm=confirm
    ):
        out.print(line, markup=False)


@k8s.command("status")
@reports_errors
def status_cmd(
    trainjob: str = typer.Argument(..., help="the TrainJob's name"),
    namespace: str = NamespaceOpt,
    context: str | None = ContextOpt,
) -> None:
    """A TrainJob's conditions and its node pods."""
    status = Cluster.connect(namespace, context).status(trainjob)
    conditions = status["conditions"] or [{"type": "-", "status": "no conditions yet"}]
    for c in conditions:
        line = f"{c.get('type')}={c.get('status')} {c.get('reason', '')} {c.get('message', '')}"
        out.print(line.rstrip(), markup=False)
    for pod in status["pods"]:
        out.print(f"{pod['pod']}  {pod['phase']}  {pod['node'] or '-'}", markup=False)


@k8s.command("logs")
@reports_errors
def logs_cmd(
    trainjob: str = typer.Argument(..., help="the TrainJob's name"),
    namespace: str = NamespaceOpt,
    context: str | None = ContextOpt,
    replicated_job: str = ReplicatedJobOpt,
) -> None:
    """Every node pod's whole log, each line tagged with its pod (as kubectl --prefix)."""
    for line in Cluster.connect(namespace, context).logs(trainjob, replicated_job):
        typer.echo(line)
