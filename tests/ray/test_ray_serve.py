"""The Ray Serve application, locally: deployed from deploy/ray/serve_config.yaml on
`ray.init(num_cpus=2)` with the default model, called through Serve's gRPC proxy. Ray's driver
runs in a child process (tests/ray/serve_process.py says why)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

pytest.importorskip("ray.serve")

from coordinator.client import build_request  # noqa: E402
from specd.grpc_server import make_channel  # noqa: E402
from specd.launcher import free_port  # noqa: E402
from specd.openmp import OPENMP_DEFAULTS  # noqa: E402
from specd.ray_serve.deploy import DEFAULT_CONFIG, ROOT, load_config  # noqa: E402
from specd.sampling import SamplingParams  # noqa: E402
from specdec.v1 import coordinator_pb2_grpc  # noqa: E402
from tests.conftest import hf_greedy  # noqa: E402
from tests.ray.serve_process import RayServeProcess  # noqa: E402

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
METADATA = (("application", "specd"),)


@pytest.fixture(scope="module")
def serve_app():
    grpc_port = free_port()
    # Two target replicas (half a CPU each, to fit 2 CPUs), so that session affinity is exercised.
    config = load_config(grpc_port=grpc_port, http_port=free_port(), args={"k": 4},
                         deployments={"target": {"ray_actor_options": {"num_cpus": 0.5},
                                                 "autoscaling_config": {"initial_replicas": 2}}})
    app = RayServeProcess(config, num_cpus=2, pythonpath=str(ROOT))
    try:
        yield app, f"127.0.0.1:{grpc_port}"
    finally:
        app.close()


def test_generate_through_the_grpc_proxy_is_exact_with_sessions_on_both_targets(serve_app, target, workload_prompts):
    app, address = serve_app
    before = app.replica_stats()
    assert len(before) == 2 and all(rid == s["replica"] for rid, s in before.items())
    cases = []
    for p in workload_prompts[:4]:
        ids = target.encode(p.prompt, chat=p.chat)
        cases.append((ids, hf_greedy(target, ids, MAX_TOKENS)))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    with make_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)

        def generate(case):
            chunks, result = [], None
            for msg in stub.Generate(build_request(case[0], params), metadata=METADATA, timeout=120):
                if msg.HasField("chunk"):
                    chunks.extend(msg.chunk.token_ids)
                else:
                    result = msg.result
            return chunks, result

        with ThreadPoolExecutor(len(cases)) as ex:
            outputs = list(ex.map(generate, cases))
        unary = stub.GenerateUnary(build_request(cases[0][0], params, method="suffix"), metadata=METADATA, timeout=120)
        # The only application on the proxy is found without the metadata too (`specd generate --address`).
        bare = stub.GenerateUnary(build_request(cases[1][0], params), timeout=120)
    drafted = 0
    for (ids, ref), (chunks, result) in zip(cases, outputs):
        assert chunks == ref
        assert list(result.token_ids) == ref
        drafted += result.stats.num_draft_tokens
    assert drafted > 0, "no request drafted anything: the draft deployment was not used"
    assert list(unary.token_ids) == cases[0][1]
    assert list(bare.token_ids) == cases[1][1]
    # Both target replicas verified sessions, and every verify found its session on the replica
    # that held it (a call routed elsewhere fails with NOT_FOUND, and the outputs would not be exact).
    after = app.replica_stats()
    assert all(after[rid]["forward_passes"] > before[rid]["forward_passes"] for rid in after), (before, after)
    assert all(s["open_sessions"] == 0 for s in after.values())


def test_bad_input_comes_back_as_invalid_argument(serve_app):
    import grpc

    _, address = serve_app
    with make_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.GenerateUnary(build_request([1, 2, 3], SamplingParams(max_tokens=4, top_p=2.0)), metadata=METADATA,
                               timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "top_p" in err.value.details()


def test_deployments_run_with_the_config_files_autoscaling(serve_app):
    app, _ = serve_app
    wanted = {d["name"]: d for d in yaml.safe_load(DEFAULT_CONFIG.read_text())["applications"][0]["deployments"]}
    details = app.details()["applications"]["specd"]["deployments"]
    assert set(details) == {"target", "draft", "coordinator"}
    for name, spec in wanted.items():
        config = details[name]["deployment_config"]
        for key, value in spec["autoscaling_config"].items():
            if key == "policy":
                assert config["autoscaling_config"]["policy"]["policy_function"] == value["policy_function"]
            else:
                assert config["autoscaling_config"][key] == value, (name, key)
        num_cpus = 0.5 if name == "target" else spec["ray_actor_options"]["num_cpus"]  # the fixture halves the target's
        assert config["ray_actor_options"]["num_cpus"] == num_cpus
        if name in ("target", "draft"):  # their replicas run model passes off the main thread
            assert config["ray_actor_options"]["runtime_env"]["env_vars"] == OPENMP_DEFAULTS
        assert details[name]["status"] == "HEALTHY"
    for name in ("target", "draft"):
        router = details[name]["deployment_config"]["request_router_config"]
        assert router["request_router_class"] == "specd.ray_serve.router:SessionAffinityRouter"
