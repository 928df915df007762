"""Deploy a Serve config file from Python, as `serve run CONFIG` does (tests, scripts).

`serve run deploy/ray/serve_config.yaml` is the way to start specd on Ray by hand; this helper
does the same steps in-process (start Serve with the file's proxy, HTTP and gRPC options, then
apply the file), with overrides for what a test must change, such as ports.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = ROOT / "deploy" / "ray" / "serve_config.yaml"


def load_config(path: str | Path = DEFAULT_CONFIG, *, grpc_port: int | None = None, http_port: int | None = None,
                args: dict[str, Any] | None = None,
                deployments: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The config file as a dict, with the given ports and application args replaced, and
    `deployments` (name -> options) merged into its deployments (one level deep: a dict option
    such as autoscaling_config is updated, not replaced)."""
    config = yaml.safe_load(Path(path).read_text())
    if grpc_port is not None:
        config.setdefault("grpc_options", {})["port"] = grpc_port
    if http_port is not None:
        config.setdefault("http_options", {})["port"] = http_port
    if args:
        for app in config["applications"]:
            app.setdefault("args", {}).update(args)
    for name, options in (deployments or {}).items():
        for app in config["applications"]:
            for dep in app.get("deployments", []):
                if dep["name"] == name:
                    for key, value in options.items():
                        if isinstance(value, dict) and isinstance(dep.get(key), dict):
                            dep[key].update(value)
                        else:
                            dep[key] = value
    return config


def deploy(config: dict[str, Any], timeout_s: float = 180.0) -> Any:
    """Starts Serve (Ray must be initialized) and applies `config`; returns once every application
    is RUNNING. Returns Serve's client (for `get_serve_details()`)."""
    import time

    from ray.serve._private import api as serve_api
    from ray.serve.config import gRPCOptions
    from ray.serve.schema import ApplicationStatus, ServeDeploySchema

    schema = ServeDeploySchema.model_validate(config)
    client = serve_api.serve_start(http_options=schema.http_options.model_dump(),
                                   grpc_options=gRPCOptions(**schema.grpc_options.model_dump()),
                                   proxy_location=schema.proxy_location)
    client.deploy_apps(schema)
    names = {app.name for app in schema.applications}
    deadline = time.monotonic() + timeout_s
    while True:
        statuses = {s.name: s.app_status for s in client.list_serve_statuses() if s.name in names}
        if len(statuses) == len(names) and all(s.status == ApplicationStatus.RUNNING for s in statuses.values()):
            break
        failed = [f"{n}: {s.message}" for n, s in statuses.items() if s.status == ApplicationStatus.DEPLOY_FAILED]
        if failed:
            raise RuntimeError("Serve application failed to deploy: " + "; ".join(failed))
        if time.monotonic() > deadline:
            raise TimeoutError(f"Serve applications not RUNNING within {timeout_s:g}s: {statuses}")
        time.sleep(0.5)
    client.wait_for_proxies_serving(wait_for_applications_running=True)
    return client
