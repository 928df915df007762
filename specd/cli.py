"""The `specd` command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Sequence

import grpc

from specd.errors import FailedPrecondition, InvalidArgument
from specd.openmp import apply_openmp_defaults


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target-model", default=None, help="hub id, local folder or .gguf file (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--method", default=None, choices=["none", "ngram", "suffix", "draft_model", "head"],
                   help="drafting method (default: ngram embedded; the coordinator's with --address)")
    p.add_argument("--draft-model", default=None, help="draft model for --method draft_model: hub id, folder, .gguf, or 'target'")
    p.add_argument("--head", default=None, metavar="DIR",
                   help="draft head for --method head, made by specd train-draft (default: the one shipped for the target)")
    p.add_argument("--k", default=None, metavar="auto|K|schedule:B=K,...",
                   help="draft depth: auto (the adaptive controller), a fixed k, or a schedule by batch size "
                        "(default: auto; the coordinator's with --address)")
    p.add_argument("--pipeline", action=argparse.BooleanOptionalAction, default=None,
                   help="pipelined drafting: draft the next block while the target verifies (default: off; "
                        "the coordinator's with --address)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default: cpu)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="weights dtype (default: float32)")


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 disables")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specd", description="speculative decoding server and tools")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text, streaming tokens as they are accepted")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="send PROMPT as one user message through the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    gen.add_argument("--address", default=None, help="HOST:PORT of a running coordinator (default: run embedded)")
    _add_client_security_flags(gen)
    _add_model_flags(gen)
    _add_sampling_flags(gen)

    from specd.config import CoordinatorConfig, DraftConfig, TargetConfig, add_config_flags

    serve = sub.add_parser("serve", help="run one service: target, draft or coordinator")
    serve_sub = serve.add_subparsers(dest="service", required=True)
    for name, cls in (("target", TargetConfig), ("draft", DraftConfig), ("coordinator", CoordinatorConfig)):
        add_config_flags(serve_sub.add_parser(name, help=f"the {name} service"), cls)

    up = sub.add_parser("up", help="start target, draft and coordinator on loopback with the default model")
    up.add_argument("--port", type=int, default=50050, help="coordinator port")
    up.add_argument("--target-port", type=int, default=50052)
    up.add_argument("--draft-port", type=int, default=50051)
    up.add_argument("--method", default="ngram", choices=["none", "ngram", "suffix", "head"],
                    help="drafting method (default ngram; head drafts with the head shipped for the bundled target)")
    up.add_argument("--k", default="auto", help="draft depth: auto, a fixed k, or schedule:B=K,... (default auto)")
    up.add_argument("--target-model", default=None)
    up.add_argument("--http-port", type=int, default=8000, help="OpenAI-compatible HTTP API port (0: off; default 8000)")
    up.add_argument("--metrics-base-port", type=int, default=9460,
                    help="Prometheus metrics: coordinator on this port, draft on +1, target on +2 (0: off; default 9460)")

    certs = sub.add_parser("certs", help="make a development CA and certificates for TLS and mutual TLS")
    certs.add_argument("--out", required=True, metavar="DIR", help="folder to write ca.crt/.key, server.crt/.key, client.crt/.key")
    certs.add_argument("--name", action="append", default=[], metavar="DNS_OR_IP",
                       help="another name for the server certificate (repeatable); localhost, 127.0.0.1 and the "
                            "Kubernetes service names are always in")
    certs.add_argument("--namespace", default="default", help="Kubernetes namespace of the service names (default: default)")
    certs.add_argument("--days", type=int, default=365, help="validity in days (default: 365)")

    diff = sub.add_parser("diff", help="rollout check: every prompt greedily with speculation off and on; exit 0 only "
                                       "when every output is identical")
    from coordinator.diff import add_diff_flags

    add_diff_flags(diff)
    _add_client_security_flags(diff)

    bench = sub.add_parser("bench", help="benchmark methods against transformers' baselines on a prompts file")
    from coordinator.bench import add_bench_flags

    add_bench_flags(bench)

    bench_stack = sub.add_parser("bench-stack", help="benchmark the distributed stack against the embedded engine")
    from coordinator.bench_stack import add_bench_stack_flags

    add_bench_stack_flags(bench_stack)

    bench_tel = sub.add_parser("bench-telemetry", help="the stack's tokens/s with telemetry on against off")
    from coordinator.bench_telemetry import add_bench_telemetry_flags

    add_bench_telemetry_flags(bench_tel)

    loadgen = sub.add_parser("loadgen", help="closed-loop or open-loop (Poisson) load against a coordinator")
    from coordinator.loadgen import add_loadgen_flags

    add_loadgen_flags(loadgen)
    bench_load = sub.add_parser("bench-load", help="speculation off vs fixed k vs auto by kind and concurrency, with plots")
    from coordinator.bench_load import add_bench_load_flags

    add_bench_load_flags(bench_load)
    train = sub.add_parser("train-draft", help="train a draft for a target by self-distillation (a head or a small LM)")
    from specd.train_draft.command import add_train_draft_flags

    add_train_draft_flags(train)
    return parser


def _params(args: argparse.Namespace):
    from specd.sampling import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    ).validate()


def _add_client_security_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-token", default=None, help="bearer token for the coordinator (default: env SPECD_API_TOKEN)")
    p.add_argument("--api-token-file", default=None, metavar="FILE", help="file holding the bearer token")
    p.add_argument("--tls-ca", default=None, metavar="FILE", help="CA to verify the coordinator with: connect over TLS")
    p.add_argument("--tls-cert", default=None, metavar="FILE", help="client certificate, for mutual TLS")
    p.add_argument("--tls-key", default=None, metavar="FILE", help="key of --tls-cert")
    p.add_argument("--server-name", default=None, help="name to check the coordinator's certificate against")


def _client_security(args: argparse.Namespace) -> dict:
    """CoordinatorClient's `token` and `tls` from the flags (and SPECD_API_TOKEN)."""
    import os

    from specd.auth import TOKEN_ENV, load_token
    from specd.tls import client_tls

    token = load_token(args.api_token or os.environ.get(TOKEN_ENV), args.api_token_file)
    return {"token": token, "tls": client_tls(args.tls_ca, args.tls_cert, args.tls_key, args.server_name)}


def cmd_certs(args: argparse.Namespace) -> int:
    from specd.certs import make_dev_certs

    files = make_dev_certs(args.out, args.name, args.namespace, args.days)
    print(f"wrote a development CA and certificates to {files.folder}:\n"
          f"  CA           {files.ca}  (ca.key: keep it off the services)\n"
          f"  services     {files.server_cert}  {files.server_key}\n"
          f"  clients      {files.client_cert}  {files.client_key}\n"
          f"serve with --tls-cert {files.server_cert} --tls-key {files.server_key} --tls-ca {files.ca} "
          f"[--require-client-cert]; the coordinator reaches TLS replicas with --upstream-ca {files.ca}")
    return 0


def cmd_generate_remote(args: argparse.Namespace) -> int:
    from coordinator.client import CoordinatorClient, build_request, result_to_dict

    request = build_request(args.prompt, _params(args), chat=args.chat, method=args.method, k=args.k,
                            pipeline=args.pipeline)
    with CoordinatorClient(args.address, **_client_security(args)) as client:
        if args.json:
            print(json.dumps(result_to_dict(client.generate(request))))
            return 0
        result = None
        for msg in client.stream(request):
            if msg.HasField("chunk"):
                sys.stdout.write(msg.chunk.text)
                sys.stdout.flush()
            else:
                result = msg.result
        sys.stdout.write("\n")
        if result is not None:
            d = result_to_dict(result)
            print(f"[{len(d['token_ids'])} tokens, finish={d['finish_reason']}, acceptance={d['stats']['acceptance_rate']:.2f}, "
                  f"mean acceptance length={d['stats']['mean_acceptance_length']:.2f}]", file=sys.stderr)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from coordinator.embedded import EngineOptions, build_engine
    from specd.text import TextStream, visible_text

    if args.address:
        return cmd_generate_remote(args)
    params = _params(args)
    opts = EngineOptions(args.target_model, args.method or "ngram", args.draft_model,
                         "auto" if args.k is None else args.k, args.device, args.dtype, pipeline=bool(args.pipeline),
                         head=args.head)
    engine, target = build_engine(opts)
    gen = engine.generate(target.encode(args.prompt, chat=args.chat), params)
    if args.json:
        gen.run()
    else:
        stream = TextStream(target.decode, params.stop)
        for chunk in gen:
            sys.stdout.write(stream.push(chunk))
            sys.stdout.flush()
        sys.stdout.write(stream.flush() + "\n")
    text = visible_text(target.decode(gen.token_ids), params.stop, final=True)
    if args.json:
        print(json.dumps({
            "text": text,
            "token_ids": gen.token_ids,
            "prompt_tokens": len(gen.prompt_ids),
            "finish_reason": gen.finish_reason,
            "time_to_first_token_s": round(gen.time_to_first_token or 0.0, 4),
            "duration_s": round(gen.duration or 0.0, 4),
            "stats": gen.stats.to_dict(),
        }))
    else:
        s = gen.stats
        print(
            f"[{len(gen.token_ids)} tokens, finish={gen.finish_reason}, {len(gen.token_ids) / max(gen.duration or 1e-9, 1e-9):.1f} tok/s, "
            f"acceptance={s.acceptance_rate:.2f}, mean acceptance length={s.mean_acceptance_length:.2f}, "
            f"target passes={s.target_forward_passes}]",
            file=sys.stderr,
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    apply_openmp_defaults()  # before any command imports torch (see specd/openmp.py)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "serve":
            from specd.config import CoordinatorConfig, DraftConfig, TargetConfig, load_config
            from specd.serve import serve

            cls = {"target": TargetConfig, "draft": DraftConfig, "coordinator": CoordinatorConfig}[args.service]
            return serve(args.service, load_config(cls, args))
        if args.command == "up":
            from specd.serve import up

            return up(args.port, args.target_port, args.draft_port, args.method, args.k, args.target_model, args.http_port or None,
                      metrics_base_port=args.metrics_base_port or None)
        if args.command == "certs":
            return cmd_certs(args)
        if args.command == "diff":
            from coordinator.diff import diff_main

            return diff_main(args, client_options=_client_security(args) if args.address else None)
        if args.command == "loadgen":
            from coordinator.loadgen import run_loadgen

            return run_loadgen(args)
        if args.command == "bench-load":
            from coordinator.bench_load import run_bench_load

            return run_bench_load(args)
        if args.command == "bench-telemetry":
            from coordinator.bench_telemetry import run_bench_telemetry

            return run_bench_telemetry(args)
        if args.command == "bench-stack":
            from coordinator.bench_stack import run_bench_stack

            return run_bench_stack(args)
        if args.command == "train-draft":
            from specd.train_draft.command import run_train_draft

            return run_train_draft(args, list(argv) if argv is not None else sys.argv[1:])
        if args.command == "bench":
            from coordinator.bench import run_bench

            return run_bench(args)
    except InvalidArgument as exc:
        print(f"specd: invalid argument: {exc}", file=sys.stderr)
        return 2
    except FailedPrecondition as exc:  # e.g. a draft model with another vocabulary than the target's
        print(f"specd: {exc}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as exc:
        print(f"specd: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:
        print(f"specd: {exc.code().name}: {exc.details()}", file=sys.stderr)  # type: ignore[attr-defined]
        return 2 if exc.code() == grpc.StatusCode.INVALID_ARGUMENT else 1  # type: ignore[attr-defined]
    return 1


if __name__ == "__main__":
    sys.exit(main())
