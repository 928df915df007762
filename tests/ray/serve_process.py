"""Ray and Serve run in a child process, and the tests talk to it over a pipe.

Ray's driver exits its whole process with status 1 when something touches the core worker
after `ray.shutdown()` (a DeploymentHandle's router thread, a Serve client's background call),
and no `try` catches it. In the pytest process that ends the run mid-line with no summary,
which CI has seen twice. Here the driver is a child that only deploys, answers
`details`/`replica_stats`, and shuts down; how it exits does not touch the test run. The
tests reach the application through Serve's gRPC proxy, as clients do.
"""

from __future__ import annotations

import multiprocessing
import os
import traceback
from multiprocessing.connection import Connection
from typing import Any

READY_TIMEOUT_S = 300.0
CALL_TIMEOUT_S = 90.0


def _stats_by_replica(replica_ids: list[str]) -> dict[str, dict]:
    """Each target replica's own stats, reached by a session id that names it (the router's rule)."""
    from ray import serve

    handle = serve.get_deployment_handle("target", "specd")
    return {rid: handle.options(session_id=f"{rid}/0").stats.remote().result(timeout_s=30) for rid in replica_ids}


def _answer(client: Any, command: str) -> Any:
    import ray

    details = client.get_serve_details()
    if command == "details":
        return details
    if command == "replica_stats":
        replicas = details["applications"]["specd"]["deployments"]["target"]["replicas"]
        task = ray.remote(num_cpus=0)(_stats_by_replica)
        return ray.get(task.remote([r["replica_id"] for r in replicas]), timeout=60)
    raise ValueError(f"unknown command {command!r}")


def _serve(conn: Connection, config: dict[str, Any], num_cpus: int) -> None:
    """The child: Ray driver and Serve deployment, answering commands until told to stop."""
    import ray
    from ray import serve

    from specd.ray_serve.deploy import deploy

    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        client = deploy(config)
        conn.send(("ok", None))
        while (command := conn.recv()) != "stop":
            try:
                conn.send(("ok", _answer(client, command)))
            except Exception:  # noqa: BLE001 - the parent raises it with the child's traceback
                conn.send(("error", traceback.format_exc()))
    except Exception:  # noqa: BLE001
        conn.send(("error", traceback.format_exc()))
    finally:
        serve.shutdown()
        ray.shutdown()


class RayServeProcess:
    """A Serve application deployed from `config` by a Ray driver in a child process."""

    def __init__(self, config: dict[str, Any], num_cpus: int = 2, pythonpath: str | None = None) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        saved = os.environ.get("PYTHONPATH")
        if pythonpath is not None:  # Ray's workers inherit the child's environment
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, saved]))
        try:
            self._process = ctx.Process(target=_serve, args=(child_conn, config, num_cpus), daemon=True)
            self._process.start()
        finally:
            if saved is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = saved
        child_conn.close()
        self._reply(READY_TIMEOUT_S, "deploy")

    def _reply(self, timeout_s: float, what: str) -> Any:
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"the Ray Serve child gave no answer to {what!r} within {timeout_s:g}s")
        status, value = self._conn.recv()
        if status == "error":
            raise RuntimeError(f"the Ray Serve child failed on {what!r}:\n{value}")
        return value

    def call(self, command: str) -> Any:
        self._conn.send(command)
        return self._reply(CALL_TIMEOUT_S, command)

    def details(self) -> dict:
        """`get_serve_details()` of the Serve client."""
        return self.call("details")

    def replica_stats(self) -> dict[str, dict]:
        """Target replica id -> that replica's stats."""
        return self.call("replica_stats")

    def close(self, timeout_s: float = 120.0) -> None:
        if self._process.is_alive():
            try:
                self._conn.send("stop")
            except (BrokenPipeError, OSError):
                pass
            self._process.join(timeout_s)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(10)
        self._conn.close()
