"""specd.config: precedence flag > env > file > default, file formats, conversion, errors, dump."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from specd.config import (
    CoordinatorConfig,
    DraftConfig,
    TargetConfig,
    add_config_flags,
    config_sources,
    convert,
    format_config,
    load_config,
)


def parse(cls, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_config_flags(parser, cls)
    return parser.parse_args(argv)


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_defaults_per_service():
    target, draft, coord = (load_config(c, None, env={}) for c in (TargetConfig, DraftConfig, CoordinatorConfig))
    assert (target.port, draft.port, coord.port) == (50052, 50051, 50050)
    assert target.host == "127.0.0.1" and target.metrics_port is None and target.max_workers == 64
    assert target.grace_seconds == 10.0 and target.log_level == "INFO"
    assert target.model is None and target.device == "cpu" and target.max_batch_size == 16
    assert draft.method == "ngram" and draft.target_model is None
    assert coord.target == ("127.0.0.1:50052",) and coord.draft == ("127.0.0.1:50051",) and coord.k == "auto"
    assert set(config_sources(target).values()) == {"default"}


def test_precedence_flag_over_env_over_file_over_default(tmp_path):
    path = write(tmp_path, "specd.toml", 'port = 1\nmax_workers = 2\ngrace_seconds = 3.5\nhost = "0.0.0.0"\n')
    env = {"SPECD_PORT": "11", "SPECD_MAX_WORKERS": "12"}
    args = parse(TargetConfig, ["--port", "21", "--config", path])
    cfg = load_config(TargetConfig, args, env=env)
    assert (cfg.port, cfg.max_workers, cfg.grace_seconds, cfg.host, cfg.device) == (21, 12, 3.5, "0.0.0.0", "cpu")
    sources = config_sources(cfg)
    assert {n: sources[n] for n in ("port", "max_workers", "grace_seconds", "host", "device")} == {
        "port": "flag", "max_workers": "env", "grace_seconds": "file", "host": "file", "device": "default"}


def test_flags_left_out_do_not_override():
    args = parse(TargetConfig, [])
    assert all(v is None for v in vars(args).values())
    cfg = load_config(TargetConfig, args, env={"SPECD_PORT": "7"})
    assert cfg.port == 7 and config_sources(cfg)["port"] == "env"


def test_file_argument_beats_args_config_and_env_config(tmp_path):
    a = write(tmp_path, "a.json", '{"port": 1}')
    b = write(tmp_path, "b.json", '{"port": 2}')
    c = write(tmp_path, "c.json", '{"port": 3}')
    args = parse(TargetConfig, ["--config", b])
    assert load_config(TargetConfig, args, env={"SPECD_CONFIG": c}, file=a).port == 1
    assert load_config(TargetConfig, args, env={"SPECD_CONFIG": c}).port == 2
    assert load_config(TargetConfig, None, env={"SPECD_CONFIG": c}).port == 3


def test_json_file(tmp_path):
    path = write(tmp_path, "c.json", json.dumps({"target": ["a:1", "b:2"], "k": 4, "http_port": 8080,
                                                "step_timeout_s": 5, "tokenizer_model": None}))
    cfg = load_config(CoordinatorConfig, None, env={}, file=path)
    assert cfg.target == ("a:1", "b:2") and cfg.k == "4" and cfg.http_port == 8080
    assert cfg.step_timeout_s == 5.0 and isinstance(cfg.step_timeout_s, float) and cfg.tokenizer_model is None


def test_toml_sections_pick_the_services_own(tmp_path):
    path = write(tmp_path, "all.toml", """
log_level = "debug"

[target]
port = 6000
model = "Qwen/Qwen3-0.6B"

[draft]
port = 6001
method = "suffix"

[coordinator]
target = ["127.0.0.1:6000"]
draft = "127.0.0.1:6001,127.0.0.1:6002"
""")
    target = load_config(TargetConfig, None, env={}, file=path)
    draft = load_config(DraftConfig, None, env={}, file=path)
    coord = load_config(CoordinatorConfig, None, env={}, file=path)
    assert (target.port, target.model, target.log_level) == (6000, "Qwen/Qwen3-0.6B", "DEBUG")
    assert (draft.port, draft.method, draft.model) == (6001, "suffix", None)
    assert coord.target == ("127.0.0.1:6000",) and coord.draft == ("127.0.0.1:6001", "127.0.0.1:6002")
    assert coord.port == 50050


def test_section_overrides_flat_keys(tmp_path):
    path = write(tmp_path, "c.toml", "port = 1\n[target]\nport = 2\n")
    assert load_config(TargetConfig, None, env={}, file=path).port == 2
    assert load_config(DraftConfig, None, env={}, file=path).port == 1


@pytest.mark.parametrize("tp, raw, expected", [
    (int, "42", 42), (int, 42, 42),
    (float, "2.5", 2.5), (float, 3, 3.0),
    (bool, "yes", True), (bool, "On", True), (bool, "1", True), (bool, "false", False), (bool, "0", False),
    (bool, True, True),
    (str, "x", "x"),
    (int | None, "", None), (int | None, "none", None), (int | None, "9", 9), (int | None, None, None),
    (str | None, "m", "m"),
    (tuple[str, ...], "a:1, b:2,", ("a:1", "b:2")), (tuple[str, ...], ["a"], ("a",)),
    (str, 4, "4"),  # `k = 4` in a TOML file, for the depth spec
])
def test_convert(tp, raw, expected):
    assert convert(tp, raw, "test") == expected


@pytest.mark.parametrize("tp, raw", [(int, "x"), (int, True), (int, 1.5), (bool, "maybe"), (float, "fast"),
                                     (str, 1.5), (str, True), (tuple[str, ...], 5)])
def test_convert_rejects(tp, raw):
    with pytest.raises(ValueError, match="test: expected"):
        convert(tp, raw, "test")


def test_env_conversion():
    env = {"SPECD_METRICS_PORT": "9100", "SPECD_BATCH_WAIT_MS": "0.5", "SPECD_DTYPE": "bfloat16",
           "SPECD_MODEL": "", "SPECD_UNRELATED": "x"}
    cfg = load_config(TargetConfig, None, env=env)
    assert cfg.metrics_port == 9100 and cfg.batch_wait_ms == 0.5 and cfg.dtype == "bfloat16"
    assert cfg.model is None and config_sources(cfg)["model"] == "default"  # empty env vars are ignored


def test_env_bad_value_names_the_variable():
    with pytest.raises(ValueError, match="SPECD_PORT"):
        load_config(TargetConfig, None, env={"SPECD_PORT": "eighty"})


def test_unknown_file_key_is_an_error(tmp_path):
    path = write(tmp_path, "c.toml", "port = 1\nbogus_key = 2\n")
    with pytest.raises(ValueError, match="bogus_key"):
        load_config(TargetConfig, None, env={}, file=path)
    section = write(tmp_path, "s.toml", "[draft]\nk = 3\n")  # k is a coordinator setting
    with pytest.raises(ValueError, match="'k'"):
        load_config(DraftConfig, None, env={}, file=section)


def test_bad_file_extension(tmp_path):
    with pytest.raises(ValueError, match=r"\.toml or \.json"):
        load_config(TargetConfig, None, env={}, file=write(tmp_path, "c.yaml", "port: 1"))


def test_validation():
    with pytest.raises(ValueError, match="method"):
        load_config(DraftConfig, None, env={"SPECD_METHOD": "magic"})
    with pytest.raises(ValueError, match="max_workers"):
        load_config(TargetConfig, parse(TargetConfig, ["--max-workers", "0"]), env={})


def test_flag_types_and_errors(capsys):
    args = parse(CoordinatorConfig, ["--target", "a:1,b:2", "--k", "3", "--step-timeout-s", "1.5", "--method", "none"])
    cfg = load_config(CoordinatorConfig, args, env={})
    assert cfg.target == ("a:1", "b:2") and cfg.k == "3" and cfg.step_timeout_s == 1.5 and cfg.method == "none"
    with pytest.raises(ValueError, match="k: depth spec 'many'"):
        load_config(CoordinatorConfig, parse(CoordinatorConfig, ["--k", "many"]), env={})
    with pytest.raises(SystemExit):
        parse(CoordinatorConfig, ["--k-max", "many"])
    assert "--k-max" in capsys.readouterr().err
    assert load_config(CoordinatorConfig, parse(CoordinatorConfig, ["--k", "schedule:1=8,8=0,floor=0.2"]), env={}).k


def test_config_is_frozen_and_replace_keeps_settings():
    cfg = load_config(TargetConfig, None, env={"SPECD_PORT": "5"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.port = 6  # type: ignore[misc]
    assert dataclasses.replace(cfg, port=0).port == 0
    assert "_sources" not in {f.name for f in dataclasses.fields(cfg)}


def test_format_config_shows_values_and_sources(tmp_path):
    path = write(tmp_path, "c.toml", "k = 5\n")
    args = parse(CoordinatorConfig, ["--port", "7000"])
    cfg = load_config(CoordinatorConfig, args, env={"SPECD_TARGET": "x:1,y:2"}, file=path)
    text = format_config(cfg)
    lines = text.splitlines()
    assert lines[0] == "specd coordinator config:"
    by_name = {line.split("=")[0].strip(): line for line in lines[1:]}
    assert by_name["port"].endswith("= 7000 (flag --port)")
    assert by_name["target"].endswith("= x:1, y:2 (env SPECD_TARGET)")
    assert by_name["k"].endswith(f"= 5 (file {path})")
    assert by_name["host"].endswith("= 127.0.0.1 (default)")
    assert len(lines) == 1 + len(dataclasses.fields(cfg))
