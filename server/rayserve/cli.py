"""``mserve ray``: deploy archives on a Ray Serve cluster, show, scale and delete them.

A thin layer over server/rayserve/app.py; Ray is imported only once a command needs a cluster,
so ``--dry-run`` and ``--help`` work without it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from server.errors import MserveError

ADDRESS_HELP = (
    "Ray cluster address (ray://host:10001, host:6379, or auto: the one running on this"
    " machine). Default: $RAY_ADDRESS, else auto."
)


def _fail(message: str, code: int = 1) -> None:
    click.echo(f"mserve ray: {message}", err=True)
    sys.exit(code)


def _ray_app() -> Any:
    """server.rayserve.app, or a clear exit when Ray Serve is not installed."""
    try:
        from server.rayserve import app
    except ImportError as exc:
        _fail(f"Ray Serve is not installed ({exc}); install it with: pip install 'mserve[ray]'")
    return app


def _run(action: Any) -> Any:
    """Errors of Ray and of ours, translated once, here: a message and an exit code."""
    from ray import exceptions as ray_exceptions

    try:
        return action()
    except MserveError as exc:
        _fail(exc.message)
    except (ConnectionError, ray_exceptions.RayError, RuntimeError, TimeoutError) as exc:
        _fail(f"{type(exc).__name__}: {exc}")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def ray_cli() -> None:
    """Serve model archives on a Ray Serve cluster (docs/ray.md)."""


@ray_cli.command()
@click.option("--models", multiple=True, required=True, help="NAME=PATH, several allowed.")
@click.option("--address", default=None, help=ADDRESS_HELP)
@click.option("--app-name", default="mserve", show_default=True, help="Serve application name.")
@click.option(
    "--cache-dir", default="~/.mserve/unpacked", show_default=True,
    help="Where archives are unpacked, on the driver and on each node (same path everywhere).",
)  # fmt: skip
@click.option("--cpus-per-replica", type=float, default=1.0, show_default=True)
@click.option(
    "--gpus-per-replica", type=float, default=None,
    help="Default: 1 for a model whose config asks for a GPU (deviceType gpu, deviceIds), else 0.",
)  # fmt: skip
@click.option("--http-host", default="127.0.0.1", show_default=True,
              help="Where Serve's HTTP proxy listens, if this starts Serve.")  # fmt: skip
@click.option("--http-port", type=int, default=8000, show_default=True)
@click.option(
    "--env-builder", type=click.Choice(["mserve", "ray"]), default="mserve", show_default=True,
    help="Who installs an archive's requirements: mserve's environment cache in each replica"
    " (once per node), or Ray's runtime_env (docs/ray.md, Requirements).",
)  # fmt: skip
@click.option("--no-uv", is_flag=True, help="With --env-builder ray: install with pip, not uv.")
@click.option("--dry-run", is_flag=True, help="Print the deployments as JSON; touch no cluster.")
def deploy(
    models: tuple[str, ...], address: str | None, app_name: str, cache_dir: str,
    cpus_per_replica: float, gpus_per_replica: float | None, http_host: str, http_port: int,
    env_builder: str, no_uv: bool, dry_run: bool,
) -> None:  # fmt: skip
    """Deploy archives as a Serve application (updates it in place when it runs)."""
    from server.rayserve.plan import Overrides, plan_models
    from server.rundir import parse_models

    overrides = Overrides(
        cpus_per_replica=cpus_per_replica, gpus_per_replica=gpus_per_replica, use_uv=not no_uv,
        env_builder=env_builder,
    )  # fmt: skip
    try:
        plans = plan_models(parse_models(list(models)), Path(cache_dir), overrides)
    except MserveError as exc:
        _fail(exc.message)
    if dry_run:
        click.echo(json.dumps([p.entry() for p in plans], indent=2))
        return
    app = _ray_app()
    _run(lambda: app.connect(address))
    _run(lambda: app.deploy(plans, app_name=app_name, http_host=http_host, http_port=http_port))
    for plan in plans:
        for note in plan.notes:
            click.echo(f"mserve ray: note: {plan.label}: {note}", err=True)
    labels = ", ".join(p.label for p in plans)
    click.echo(f"deployed {labels} as Serve application {app_name!r}")


@ray_cli.command()
@click.option("--address", default=None, help=ADDRESS_HELP)
@click.option("--app-name", default="mserve", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the whole description as JSON.")
def status(address: str | None, app_name: str, as_json: bool) -> None:
    """Show each model's deployment: state, replicas, settings."""
    app = _ray_app()
    _run(lambda: app.connect(address))
    described = _run(lambda: app.describe(app_name))
    if as_json:
        click.echo(json.dumps(described, indent=2))
        return
    click.echo(f"application {app_name}: {described['status']}")
    for m in described["models"]:
        replicas = ", ".join(f"{n} {state.lower()}" for state, n in m["replicas"].items()) or "none"
        s = m["settings"]
        default = " (default)" if m["default"] else ""
        click.echo(
            f"  model {m['modelName']}:{m['modelVersion']}{default}: {m['status']}, replicas"
            f" {replicas}; workers {s['minWorkers']}-{s['maxWorkers']}, batch {s['batchSize']}"
            f" / {s['maxBatchDelay']} ms"
        )
        if m["message"]:
            click.echo(f"    {m['message']}")


@ray_cli.command()
@click.argument("model")
@click.option("--min-workers", type=int, required=True, help="Replicas (autoscaling floor).")
@click.option("--max-workers", type=int, default=None, help="Autoscaling ceiling.")
@click.option("--address", default=None, help=ADDRESS_HELP)
@click.option("--app-name", default="mserve", show_default=True)
def scale(
    model: str, min_workers: int, max_workers: int | None, address: str | None, app_name: str
) -> None:
    """Scale MODEL (NAME or NAME/VERSION), as the management API's min_worker and max_worker."""
    name, _, version = model.partition("/")
    app = _ray_app()
    _run(lambda: app.connect(address))
    entry = _run(lambda: app.scale(name, version or None, min_workers, max_workers, app_name))
    s = entry["settings"]
    click.echo(f"scaled {name}:{entry['version']} to {s['minWorkers']}-{s['maxWorkers']} replicas")


@ray_cli.command()
@click.option("--address", default=None, help=ADDRESS_HELP)
@click.option("--app-name", default="mserve", show_default=True)
def delete(address: str | None, app_name: str) -> None:
    """Delete the Serve application and its deployments."""
    app = _ray_app()
    _run(lambda: app.connect(address))
    _run(lambda: app.delete(app_name))
    click.echo(f"deleted Serve application {app_name!r}")


def main(argv: list[str]) -> None:
    ray_cli.main(args=argv, prog_name="mserve ray")
