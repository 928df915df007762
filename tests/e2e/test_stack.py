"""End to end: target, draft and coordinator as three real processes on loopback."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from coordinator.client import CoordinatorClient, build_request
from specd.grpc_server import make_channel
from specd.launcher import start_service
from specd.sampling import SamplingParams
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from tests.conftest import EXACTNESS_MAX_TOKENS, one_prompt_per_kind
from tests.e2e.conftest import draft_stats, target_stats, wait_sessions_closed

pytestmark = pytest.mark.slow


SWEEP_STREAMS = 4  # concurrent streams in the greedy sweeps through the stack
SERVICES = {"target": "specdec.v1.TargetService", "draft": "specdec.v1.DraftService", "coordinator": "specdec.v1.Coordinator"}


def test_health_serving_and_reflection_on_all_three(stack):
    for name, service in SERVICES.items():
        address = getattr(stack, name).address
        with make_channel(address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            for svc in ("", service):
                assert health.Check(health_pb2.HealthCheckRequest(service=svc), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
            services = ProtoReflectionDescriptorDatabase(ch).get_services()
            assert service in services and "grpc.health.v1.Health" in services


def test_target_and_draft_models_run_onednn_linear_layers(stack):
    """The default kernel on a CPU (specd/cpu_kernels.py): the exactness tests below then compare
    services running it with transformers' stock generation in this process."""
    for service in (stack.target, stack.draft):
        swapped = re.search(r"linear layers: oneDNN \((\d+) layers\)", service.log.read_text())
        assert swapped and int(swapped.group(1)) > 0, f"{service.name} does not run oneDNN linear layers"


def test_the_targets_model_thread_owns_the_only_openmp_team(stack):
    """specd/openmp.py: the target loads its model with a serial main thread and runs its passes
    on the scheduler's thread with the cores' threads, so libgomp does not throttle its workers."""
    line = re.search(r"model thread: (\d+) torch threads, the main thread serial", stack.target.log.read_text())
    assert line and int(line.group(1)) >= 1, "the target's scheduler did not take the torch threads"


@pytest.mark.parametrize("method,depth,pipeline", [(method, "auto", True) for method in ("ngram", "suffix", "draft_model")]
                         + [(method, 4, False) for method in ("ngram", "suffix")])
def test_greedy_output_equals_target_only(method, depth, pipeline, client, references, workload_prompts, stack):
    """Auto depth with pipelining (what the coordinator runs by default) on every workload prompt; a fixed
    depth on one prompt of each kind, for the copying drafts (fixed depths are checked in-process
    for every method, test_greedy_exactness). SWEEP_STREAMS prompts at a time: the target batches
    their verifies (a pass of four rows costs about what one of one does on a CPU), and every
    stream must still be exactly what the target alone produces."""
    prompts = workload_prompts if depth == "auto" else one_prompt_per_kind(workload_prompts)

    def run(p) -> int:
        ids, expected = references[p.id]
        req = build_request(ids, SamplingParams(max_tokens=min(p.max_tokens, EXACTNESS_MAX_TOKENS)), method=method, k=depth,
                            pipeline=pipeline)
        chunks, result, chunk_ks = [], None, []
        for msg in client.stream(req, timeout=300):
            if msg.HasField("chunk"):
                chunks.extend(msg.chunk.token_ids)
                chunk_ks.append(msg.chunk.k if msg.chunk.HasField("k") else None)
            else:
                result = msg.result
        assert chunks == expected, f"{method}: {p.id} differs from target-only decoding"
        # each verify step's chunk says its k as it streams; the prefill's token says none
        assert chunk_ks[0] is None and [k for k in chunk_ks if k is not None] == list(result.stats.k_per_step)
        assert list(result.token_ids) == expected
        assert result.usage.completion_tokens == len(expected) and result.usage.prompt_tokens == len(ids)
        return result.stats.num_draft_tokens

    # One code edit alone first: at one session auto must speculate on a copying prompt, whereas
    # at SWEEP_STREAMS sessions of 20 tokens the controller may rightly never draft (a CPU pass
    # of four rows gains little from drafted positions), which would leave the sweep untested.
    solo = next(p for p in prompts if p.kind == "code_edit")
    assert run(solo) > 0, f"{method}: nothing drafted on {solo.id} at one session"
    with ThreadPoolExecutor(SWEEP_STREAMS) as pool:
        list(pool.map(run, [p for p in prompts if p is not solo]))


@pytest.mark.parametrize("depth,pipeline", [(None, None), ("auto", True)])  # the coordinator's defaults; auto + pipelined
def test_eight_concurrent_streams_are_exact_and_batched(depth, pipeline, client, references, workload_prompts, stack):
    before = {b.batch_size: b.count for b in target_stats(stack).batch_sizes}
    prompts = workload_prompts[:8]

    def run(p):
        ids, expected = references[p.id]
        params = SamplingParams(max_tokens=min(p.max_tokens, EXACTNESS_MAX_TOKENS))
        res = client.generate(build_request(ids, params, k=depth, pipeline=pipeline), timeout=300)
        return p.id, list(res.token_ids), expected

    with ThreadPoolExecutor(8) as pool:
        for pid, got, expected in pool.map(run, prompts):
            assert got == expected, f"{pid} differs under concurrency"
    after = {b.batch_size: b.count for b in target_stats(stack).batch_sizes}
    grown = {size for size, count in after.items() if count > before.get(size, 0)}
    assert max(grown) > 1, f"no verify pass had more than one session: {after}"


def test_cancelled_stream_frees_sessions_on_both_services(client, stack):
    req = build_request("Write a long story about a dragon.", SamplingParams(max_tokens=400, ignore_eos=True))
    call = client.stream(req)
    next(call), next(call)  # the stream is under way
    assert target_stats(stack).open_sessions == 1
    call.cancel()
    assert wait_sessions_closed(stack) == (0, 0)


def test_expired_deadline_frees_sessions_on_both_services(client, stack):
    req = build_request("Write a long story about a dragon.", SamplingParams(max_tokens=400, ignore_eos=True))
    with pytest.raises(grpc.RpcError) as err:
        client.generate(req, timeout=1.5)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_sessions_closed(stack) == (0, 0)


@pytest.mark.parametrize("params,field", [
    (SamplingParams(top_p=1.5), "top_p"),
    (SamplingParams(temperature=-0.5), "temperature"),
    (SamplingParams(top_k=-2), "top_k"),
])
def test_bad_input_is_invalid_argument_naming_the_field(client, params, field):
    with pytest.raises(grpc.RpcError) as err:
        client.generate(build_request("hi", params), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    assert client.generate(build_request("hi", SamplingParams(max_tokens=2)), timeout=60).usage.completion_tokens == 2


def test_prompt_over_the_context_is_invalid_argument(client):
    with pytest.raises(grpc.RpcError) as err:
        client.generate(build_request(list(range(100, 9000)), SamplingParams(max_tokens=2)), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "context" in err.value.details()


def test_unknown_first_message_on_internal_services(stack):
    with make_channel(stack.target.address) as ch:
        stub = target_pb2_grpc.TargetServiceStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Session(iter([target_pb2.TargetRequest(verify=target_pb2.VerifyBlock())]), timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "open" in err.value.details()
    with make_channel(stack.draft.address) as ch:
        stub = draft_pb2_grpc.DraftServiceStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Session(iter([draft_pb2.DraftRequest(open=draft_pb2.OpenDraftSession(
                prompt_token_ids=[1, 2], method=common_pb2.DRAFT_METHOD_DRAFT_MODEL + 7))]), timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "method" in err.value.details()


def test_sigterm_during_a_stream_lets_it_finish(stack, tmp_path):
    coordinator = start_service("coordinator", ["--target", stack.target.address, "--draft", stack.draft.address], tmp_path)
    with CoordinatorClient(coordinator.address) as c:
        call = c.stream(build_request("Count from one to fifty in words.", SamplingParams(max_tokens=48, ignore_eos=True)), timeout=120)
        first = next(call)
        assert first.HasField("chunk")
        coordinator.proc.send_signal(15)
        rest = list(call)
    assert rest[-1].HasField("result") and rest[-1].result.usage.completion_tokens == 48
    assert coordinator.proc.wait(30) == 0
