"""Service configuration: one dataclass per service, filled from flags, environment and a file.

Precedence, highest first: command-line flags the user actually passed, `SPECD_<FIELD>`
environment variables, the config file (TOML or JSON), the field defaults. `load_config` records
where each value came from so `format_config` can print it at start: most "why is it listening
there" questions are answered by that one dump.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tomllib
import types
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, TypeVar, Union, get_args, get_origin, get_type_hints

ENV_PREFIX = "SPECD_"
# The file to read when neither `file` nor `--config` names one.
CONFIG_FILE_ENV = "SPECD_CONFIG"
SERVICES = ("target", "draft", "coordinator")
DRAFT_METHODS = ("none", "ngram", "suffix", "draft_model", "head")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# How a CPU model's linear layers multiply: oneDNN's inner product, or torch's default (specd/cpu_kernels.py).
LINEAR_KERNELS = ("onednn", "aten")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_NONE = ("", "none", "null")

C = TypeVar("C", bound="ServiceConfig")


def _opt(default: Any, help: str, *, choices: tuple[str, ...] | None = None, minimum: float | None = None,
         metavar: str | None = None, secret: bool = False, check: Callable[[Any], None] | None = None) -> Any:
    """A dataclass field whose metadata drives the flag's help text and validation. A `secret`
    field's value is never printed (`format_config` shows it as set or unset)."""
    metadata = {"help": help, "choices": choices, "min": minimum, "metavar": metavar, "secret": secret, "check": check}
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(frozen=True)
class ServiceConfig:
    """Fields every service shares. Subclasses set `service` and their own port default."""

    service: ClassVar[str] = ""

    host: str = _opt("127.0.0.1", "address to listen on", metavar="HOST")
    port: int = _opt(0, "gRPC port (0 picks a free one)", minimum=0)
    metrics_port: int | None = _opt(None, "Prometheus metrics port (unset: no metrics endpoint)", minimum=0)
    max_workers: int = _opt(64, "gRPC handler threads", minimum=1)
    grace_seconds: float = _opt(10.0, "seconds in-flight RPCs get to finish on SIGTERM", minimum=0)
    log_level: str = _opt("INFO", "logging level", choices=LOG_LEVELS)
    max_message_mb: int = _opt(64, "largest gRPC message in MiB, either way; larger ones get RESOURCE_EXHAUSTED",
                               minimum=1)
    tls_cert: str | None = _opt(None, "PEM certificate to serve TLS with (with tls_key; unset: plaintext)", metavar="FILE")
    tls_key: str | None = _opt(None, "PEM private key of tls_cert", metavar="FILE")
    tls_ca: str | None = _opt(None, "PEM CA bundle that signs the clients' certificates (for require_client_cert)",
                              metavar="FILE")
    require_client_cert: bool = _opt(False, "mutual TLS: refuse clients without a certificate signed by tls_ca")

    def __post_init__(self) -> None:
        object.__setattr__(self, "log_level", self.log_level.upper())
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            choices, low = f.metadata.get("choices"), f.metadata.get("min")
            if choices is not None and value not in choices:
                raise ValueError(f"{f.name}: {value!r} is not one of {', '.join(choices)}")
            if low is not None and value is not None and value < low:
                raise ValueError(f"{f.name}: {value!r} is below the minimum {low}")
            check = f.metadata.get("check")
            if check is not None and value is not None:
                try:
                    check(value)
                except ValueError as exc:
                    raise ValueError(f"{f.name}: {exc}") from None


def _check_depth(spec: str) -> None:
    """A depth spec the controller understands: "auto", an integer k, "schedule:B=K,...", ",floor=A"."""
    from coordinator.controller import make_controller  # pure policy module, no heavy imports

    make_controller(str(spec), 32)


@dataclass(frozen=True)
class TargetConfig(ServiceConfig):
    """The target (verifier) service."""

    service: ClassVar[str] = "target"

    port: int = _opt(50052, "gRPC port (0 picks a free one)", minimum=0)
    model: str | None = _opt(None, "target model: Hugging Face id, folder or GGUF file (unset: bundled default)")
    device: str = _opt("cpu", "torch device, e.g. cpu, cuda, cuda:1")
    dtype: str | None = _opt(None, "torch dtype, e.g. float32, bfloat16 (unset: the model's)")
    linear_kernel: str = _opt("onednn", "kernel of a float32 CPU model's linear layers: onednn (faster on few token "
                                        "rows) or aten (torch's default)", choices=LINEAR_KERNELS)
    max_sessions: int = _opt(64, "sessions admitted at once; more are refused with RESOURCE_EXHAUSTED", minimum=1)
    max_batch_size: int = _opt(16, "most verify requests sharing one forward pass", minimum=1)
    batch_wait_ms: float = _opt(2.0, "how long a forward pass waits for more requests to batch", minimum=0)
    straggler_wait_ms: float = _opt(40.0, "longest a forward pass waits for sessions that just got a result and are "
                                          "on their way back with the next block (at most half a pass; 0: off)", minimum=0)
    session_ttl_s: float = _opt(600.0, "idle seconds after which a session is closed", minimum=0)
    packed_passes: bool = _opt(True, "run a verify pass whose rows bring blocks of different lengths on their real "
                                     "tokens only, not padded to the longest block")
    kv_budget_mb: float | None = _opt(None, "KV cache memory budget in MiB; caps max_sessions at budget / "
                                      "(KV bytes per token x max context) (unset: max_sessions alone)", minimum=0)


@dataclass(frozen=True)
class DraftConfig(ServiceConfig):
    """The draft (proposer) service."""

    service: ClassVar[str] = "draft"

    port: int = _opt(50051, "gRPC port (0 picks a free one)", minimum=0)
    method: str = _opt("ngram", "default drafting method", choices=DRAFT_METHODS)
    model: str | None = _opt(None, "draft model spec, for method draft_model")
    device: str = _opt("cpu", "torch device of the draft model")
    dtype: str | None = _opt(None, "torch dtype of the draft model (unset: the model's)")
    linear_kernel: str = _opt("onednn", "kernel of a float32 CPU draft model's linear layers: onednn or aten",
                              choices=LINEAR_KERNELS)
    target_model: str | None = _opt(None, "the target: tokenizer source for model-free methods, embedding and LM head "
                                          "for method head (unset: bundled default)")
    head: str | None = _opt(None, "trained draft head directory (specd train-draft) for method head (unset: the head "
                                  "shipped for the bundled target, when method is head)")


@dataclass(frozen=True)
class CoordinatorConfig(ServiceConfig):
    """The client-facing coordinator."""

    service: ClassVar[str] = "coordinator"

    port: int = _opt(50050, "gRPC port (0 picks a free one)", minimum=0)
    target: tuple[str, ...] = _opt(("127.0.0.1:50052",), "target replicas, comma-separated: HOST:PORT, or "
                                   "dns:///NAME:PORT for every A/AAAA record of NAME (re-resolved)",
                                   metavar="HOST:PORT|dns:///NAME:PORT,...")
    draft: tuple[str, ...] = _opt(("127.0.0.1:50051",), "draft replicas, comma-separated: HOST:PORT, or "
                                  "dns:///NAME:PORT for every A/AAAA record of NAME (re-resolved)",
                                  metavar="HOST:PORT|dns:///NAME:PORT,...")
    dns_refresh_s: float = _opt(10.0, "seconds between re-resolutions of dns:/// replica names", minimum=0.1)
    health_check_interval_s: float = _opt(1.0, "seconds between health checks of each replica (0: off)", minimum=0)
    method: str = _opt("ngram", "default drafting method", choices=DRAFT_METHODS)
    k: str = _opt("auto", "default draft depth: auto (the adaptive controller), a fixed k (0: no speculation), or "
                          "schedule:B=K,... (k by batch size); each may end with ,floor=A (acceptance below A turns "
                          "speculation off)", metavar="auto|K|schedule:B=K,...", check=_check_depth)
    k_max: int = _opt(16, "deepest draft block the controller may choose", minimum=1)
    pipeline: bool = _opt(False, "pipelined drafting: draft block n+1 while block n is verified")
    http_port: int | None = _opt(None, "HTTP (OpenAI-style) port (unset: no HTTP endpoint)", minimum=0)
    tokenizer_model: str | None = _opt(None, "tokenizer source (unset: bundled default)")
    max_message_mb: int = _opt(4, "largest client message in MiB, either way; larger ones get RESOURCE_EXHAUSTED "
                                  "(channels to the replicas allow 64)", minimum=1)
    max_running: int = _opt(64, "requests generating at once; more wait in the queue", minimum=1)
    max_queue: int = _opt(256, "requests waiting at most; more are refused with RESOURCE_EXHAUSTED", minimum=0)
    queue_timeout_s: float = _opt(30.0, "longest wait in the queue before RESOURCE_EXHAUSTED", minimum=0)
    api_token: str | None = _opt(None, "bearer token clients must send (prefer env SPECD_API_TOKEN or api_token_file)",
                                 secret=True, metavar="TOKEN")
    api_token_file: str | None = _opt(None, "file holding the bearer token clients must send", metavar="FILE")
    upstream_ca: str | None = _opt(None, "PEM CA that signs the replicas' certificates: TLS to target and draft "
                                   "(unset: plaintext)", metavar="FILE")
    upstream_cert: str | None = _opt(None, "client certificate for mutual TLS to the replicas (unset: tls_cert)",
                                     metavar="FILE")
    upstream_key: str | None = _opt(None, "key of upstream_cert (unset: tls_key)", metavar="FILE")
    upstream_server_name: str | None = _opt(None, "name to check the replicas' certificates against (unset: the "
                                            "address's host)", metavar="NAME")
    step_timeout_s: float = _opt(30.0, "longest wait for one prefill or verify call; past it the session moves to "
                                       "another target replica (0: no limit)", minimum=0)
    draft_budget_ms: float = _opt(1000.0, "longest wait for one draft block; past it the request goes on without "
                                          "speculation for a while (0: no limit)", minimum=0)


# --- type conversion -------------------------------------------------------------------------


def _field_types(cls: type[ServiceConfig]) -> dict[str, Any]:
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _optional_inner(tp: Any) -> Any | None:
    """X for `X | None`, else None."""
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(get_args(tp)) == 2:
            return args[0]
    return None


def _type_name(tp: Any) -> str:
    inner = _optional_inner(tp)
    if inner is not None:
        return f"optional {_type_name(inner)}"
    if get_origin(tp) is tuple:
        return f"comma-separated list of {_type_name(get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def convert(tp: Any, raw: Any, where: str) -> Any:
    """Converts a raw value (a string from flags or env, or a TOML/JSON value) to type `tp`.

    `where` names the value's origin (e.g. "env SPECD_PORT") for the error message.
    """

    def bad() -> ValueError:
        return ValueError(f"{where}: expected {_type_name(tp)}, got {raw!r}")

    inner = _optional_inner(tp)
    if inner is not None:
        if raw is None or (isinstance(raw, str) and raw.strip().lower() in _NONE):
            return None
        return convert(inner, raw, where)
    if get_origin(tp) is tuple:
        (item,) = [a for a in get_args(tp) if a is not Ellipsis]
        if isinstance(raw, str):
            parts: list[Any] = [p.strip() for p in raw.split(",") if p.strip()]
        elif isinstance(raw, (list, tuple)):
            parts = list(raw)
        else:
            raise bad()
        return tuple(convert(item, p, where) for p in parts)
    if tp is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.strip().lower() in _TRUE + _FALSE:
            return raw.strip().lower() in _TRUE
        raise bad()
    if tp is int:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        if isinstance(raw, str):
            try:
                return int(raw.strip())
            except ValueError:
                raise bad() from None
        raise bad()
    if tp is float:
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return float(raw)
        if isinstance(raw, str):
            try:
                return float(raw.strip())
            except ValueError:
                raise bad() from None
        raise bad()
    if tp is str:
        if isinstance(raw, str):
            return raw
        if isinstance(raw, int) and not isinstance(raw, bool):  # `k = 4` in a file
            return str(raw)
        raise bad()
    raise TypeError(f"{where}: config fields of type {tp!r} are not supported")


# --- sources ---------------------------------------------------------------------------------


def env_var(name: str) -> str:
    """The environment variable of field `name`: SPECD_<NAME>."""
    return ENV_PREFIX + name.upper()


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def read_config_file(path: str | os.PathLike[str], service: str) -> dict[str, Any]:
    """The raw values of `service` in a TOML or JSON file: flat keys, overridden by the `[service]`
    table. Tables of the other services are skipped, so one file can configure all three."""
    p = Path(path)
    if p.suffix.lower() == ".toml":
        with p.open("rb") as fh:
            data = tomllib.load(fh)
    elif p.suffix.lower() == ".json":
        with p.open(encoding="utf-8") as fh:
            data = json.load(fh)
    else:
        raise ValueError(f"{path}: config files must end in .toml or .json")
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a table of settings at the top level")
    flat: dict[str, Any] = {}
    section: dict[str, Any] = {}
    for key, value in data.items():
        # A coordinator has a `target` field too (a list), so only a table counts as a section.
        if key in SERVICES and isinstance(value, dict):
            if key == service:
                section = value
            continue
        flat[key] = value
    return {**flat, **section}


def load_config(cls: type[C], args: argparse.Namespace | None = None, env: Mapping[str, str] = os.environ,
                file: str | os.PathLike[str] | None = None) -> C:
    """Builds `cls` from flags > environment > file > defaults.

    Only attributes of `args` that are not None count as flags, so parsers must default them to
    None (`add_config_flags` does). The file is `file`, else `args.config`, else $SPECD_CONFIG.
    Empty environment variables are ignored. Raises ValueError for unknown file keys and for
    values that do not convert or validate.
    """
    types_ = _field_types(cls)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    path = file or (getattr(args, "config", None) if args is not None else None) or env.get(CONFIG_FILE_ENV) or None

    if path:
        raw_file = read_config_file(path, cls.service)
        unknown = [k for k in raw_file if k not in types_]
        if unknown:
            raise ValueError(f"{path}: unknown key {unknown[0]!r} for the {cls.service} config "
                             f"(known: {', '.join(types_)})")
        for name, raw in raw_file.items():
            values[name] = convert(types_[name], raw, f"{path}: {name}")
            sources[name] = "file"
    for name, tp in types_.items():
        raw = env.get(env_var(name))
        if raw is not None and raw != "":
            values[name] = convert(tp, raw, f"env {env_var(name)}")
            sources[name] = "env"
    if args is not None:
        for name, tp in types_.items():
            raw = getattr(args, name, None)
            if raw is not None:
                values[name] = convert(tp, raw, f"flag {flag_name(name)}")
                sources[name] = "flag"

    cfg = cls(**values)
    # Kept off the dataclass fields so equality, replace() and asdict() see only settings.
    object.__setattr__(cfg, "_sources", {name: sources.get(name, "default") for name in types_})
    object.__setattr__(cfg, "_file", str(path) if path else None)
    return cfg


def config_sources(cfg: ServiceConfig) -> dict[str, str]:
    """Field name -> "flag", "env", "file" or "default" (all "default" if not from load_config)."""
    recorded = getattr(cfg, "_sources", {})
    return {f.name: recorded.get(f.name, "default") for f in dataclasses.fields(cfg)}


def _format_value(value: Any) -> str:
    if isinstance(value, tuple):
        return ", ".join(map(str, value)) or "(empty)"
    return str(value)


def _is_secret(cls: type, name: str) -> bool:
    return any(f.name == name and f.metadata.get("secret") for f in dataclasses.fields(cls))


def format_config(cfg: ServiceConfig) -> str:
    """A multi-line dump, one `field = value (source)` line per field, for the start-up log."""
    sources = config_sources(cfg)
    names = [f.name for f in dataclasses.fields(cfg)]
    width = max(map(len, names))
    lines = [f"specd {cfg.service} config:"]
    for name in names:
        source = sources[name]
        detail = {"flag": f"flag {flag_name(name)}", "env": f"env {env_var(name)}",
                  "file": f"file {getattr(cfg, '_file', None)}"}.get(source, source)
        value = getattr(cfg, name)
        shown = ("(set)" if value else "(unset)") if _is_secret(type(cfg), name) else _format_value(value)
        lines.append(f"  {name:<{width}} = {shown} ({detail})")
    return "\n".join(lines)


# --- flags -----------------------------------------------------------------------------------


def _flag_type(tp: Any, name: str) -> Callable[[str], Any]:
    def parse(raw: str) -> Any:
        return convert(tp, raw, f"flag {flag_name(name)}")

    # argparse names the type in its error message: "invalid int value: 'x'".
    parse.__name__ = _type_name(tp)
    return parse


def add_config_flags(parser: argparse.ArgumentParser, cls: type[ServiceConfig]) -> None:
    """Adds `--config FILE` and one `--field-name` flag per field of `cls`, all defaulting to None
    so `load_config` can tell the flags the user passed from the ones left out."""
    parser.add_argument("--config", default=None, metavar="FILE",
                        help=f"TOML or JSON config file (env {CONFIG_FILE_ENV})")
    types_ = _field_types(cls)
    for f in dataclasses.fields(cls):
        tp = types_[f.name]
        default = _format_value(f.default)
        help_text = f"{f.metadata.get('help', '')} (default: {default}; env {env_var(f.name)})".replace("%", "%%")
        kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": help_text}
        if tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = _flag_type(tp, f.name)
            # Choices are checked by the dataclass (case-insensitively for log_level), not argparse.
            choices = f.metadata.get("choices")
            metavar = f.metadata.get("metavar") or ("{" + ",".join(choices) + "}" if choices else None)
            if metavar:
                kwargs["metavar"] = metavar
        parser.add_argument(flag_name(f.name), **kwargs)
