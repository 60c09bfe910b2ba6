"""``muster k8s ...``: the Kubernetes backend through Kubeflow Trainer (muster.k8s)."""

from __future__ import annotations

from pathlib import Path

import typer

from muster.cli.main import app, err, reports_errors
from muster.errors import FieldError, SpecError
from muster.k8s.fabric import FABRICS
from muster.k8s.render import TRAINER_VERSIONS, RenderOptions, render
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
    nccl_env: str = "inline",
    nccl_debug: str | None = None,
) -> RenderOptions:
    errors = []
    if fabric not in FABRICS:
        errors.append(FieldError("--fabric", f"{fabric!r}: choose one of {', '.join(FABRICS)}"))
    if trainer_version not in TRAINER_VERSIONS:
        errors.append(FieldError("--trainer-version", f"{trainer_version!r}: choose 2.2 or 2.3"))
    if nccl_env not in ("inline", "profile"):
        errors.append(FieldError("--nccl-env", f"{nccl_env!r}: choose inline or profile"))
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
    )


@k8s.command("render")
@reports_errors
def render_cmd(
    job_file: Path = typer.Argument(..., help="the job's YAML file"),
    fabric: str = FabricOpt,
    trainer_version: str = VersionOpt,
    namespace: str = NamespaceOpt,
    runtime: str | None = typer.Option(
        None, "--runtime", help="runtime name [tcpxo: JOB-tcpxo, written; else torch-distributed]"
    ),
    gpu_nic_networks: str | None = typer.Option(
        None, "--gpu-nic-networks", help="tcpxo: the eight gpu-nic Network names, comma-separated"
    ),
    efa_count: int | None = typer.Option(None, "--efa-count", help="efa: EFA devices per node"),
    node_selector: list[str] = typer.Option([], "--node-selector", help="KEY=VALUE (repeat)"),
    toleration: list[str] = typer.Option([], "--toleration", help="KEY[=VALUE][:EFFECT] (repeat)"),
    nccl_env: str = typer.Option(
        "inline", "--nccl-env", help="tcpxo: NCCL values inline, or `profile` (source the plugin's)"
    ),
    nccl_debug: str | None = typer.Option(
        None, "--nccl-debug", help="set NCCL_DEBUG (INFO for a `muster verify-fabric` run)"
    ),
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
    )
    rendered = render(spec, opts)
    for warning in rendered.warnings:
        err.print(f"[yellow]warning:[/] {warning}", markup=True, highlight=False)
    typer.echo(rendered.to_yaml(), nl=False)
