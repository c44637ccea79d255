"""The smg-bench command line: the benchmark registry and the gateway benchmark's settings."""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from pathlib import Path

import pytest

from shepherd.loadgen.benchmarks import registry
from shepherd.loadgen.benchmarks.gateway import ratio_lines, settings_from_args
from shepherd.loadgen.report import RunRow
from shepherd.loadgen.targets import MODEL_CONFIG, extract_tokenizer, mock_engine_spec


def parse(*argv: str) -> argparse.Namespace:
    bench = registry()["gateway"]
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(list(argv))


def test_registry_has_gateway_in_all() -> None:
    benches = registry()
    assert "gateway" in benches
    assert benches["gateway"].in_all


def test_gateway_defaults() -> None:
    s = settings_from_args(parse("--no-pin"))
    assert s.concurrency == (32, 128)
    assert s.workloads == ("chat", "stream")
    assert s.targets == ("direct", "node")
    assert s.peers == ()
    assert s.prompt.prompt_tokens == 250
    assert s.prompt.repeat_ratio == 0.0
    assert s.max_tokens == 32
    assert s.engine_cpus is None


def test_gateway_flags() -> None:
    s = settings_from_args(
        parse(
            "--concurrency",
            "4,8",
            "--peers",
            "smg",
            "--workloads",
            "stream",
            "--repeat-ratio",
            "0.5",
            "--no-pin",
        )
    )
    assert s.concurrency == (4, 8)
    assert s.peers == ("smg",)
    assert s.workloads == ("stream",)
    assert s.prompt.repeat_ratio == 0.5


def _row(target: str, conc: int, cpu: float) -> RunRow:
    nan = math.nan
    return RunRow("stream", target, conc, 10, 10.0, 1.0, nan, nan, nan, nan, nan, nan, cpu, nan, 3, nan, nan)


def test_rounds_flag_and_the_ratio_per_round() -> None:
    assert settings_from_args(parse("--no-pin")).rounds == 1
    assert settings_from_args(parse("--no-pin", "--rounds", "3")).rounds == 3
    assert settings_from_args(parse("--no-pin", "--rounds", "0")).rounds == 1
    rows = [  # rounds alternate the order; the i-th run of each side makes round i's ratio
        _row("node", 32, 2.0),
        _row("smg", 32, 4.0),
        _row("smg", 32, 3.0),
        _row("node", 32, 3.0),
        _row("node", 32, 2.4),
        _row("smg", 32, 3.0),
        _row("direct", 32, math.nan),  # no gateway: no ratio
        _row("node", 128, 1.0),
        _row("smg", 128, 0.0),  # a run with no CPU figure: skipped, not a division by zero
    ]
    pooled = (2.0 + 3.0 + 2.4) / (4.0 + 3.0 + 3.0)  # every run has 10 requests: the plain means
    assert ratio_lines(rows) == [
        f"c=32 node/smg CPU per request: 0.50 1.00 0.80 (median 0.80, pooled {pooled:.2f})"
    ]
    heavy = [replace(rows[0], ok=30), *rows[1:6]]  # a run with 3x the requests weighs 3x
    pooled = (2.0 * 30 + 3.0 * 10 + 2.4 * 10) / (30 + 10 + 10) / ((4.0 + 3.0 + 3.0) / 3)
    assert ratio_lines(heavy)[0].endswith(f"pooled {pooled:.2f})")


def test_gateway_paced_flags_reach_the_mock_engine() -> None:
    s = settings_from_args(parse("--no-pin"))
    assert (s.decode_ms_per_token, s.stream_interval, s.turns) == (0.0, 1, 1)
    burst = mock_engine_spec(1, 2, cpus=None)
    assert "--zero-latency" in burst.argv and "--decode-ms-per-token" not in burst.argv
    s = settings_from_args(
        parse("--decode-ms-per-token", "5", "--stream-interval", "2", "--turns", "4", "--no-pin")
    )
    assert (s.decode_ms_per_token, s.stream_interval, s.turns) == (5.0, 2, 4)
    paced = mock_engine_spec(
        1, 2, cpus=None, decode_ms_per_token=s.decode_ms_per_token, stream_interval=s.stream_interval
    )
    argv = list(paced.argv)
    assert "--zero-latency" not in argv
    assert argv[argv.index("--decode-ms-per-token") + 1] == "5.0"
    assert argv[argv.index("--stream-interval") + 1] == "2"
    assert argv[argv.index("--decode-slowdown") + 1] == "0"


@pytest.mark.parametrize("flag", ["--peers", "--targets", "--workloads"])
def test_unknown_names_are_refused(flag: str) -> None:
    with pytest.raises(SystemExit):
        settings_from_args(parse(flag, "nope", "--no-pin"))


def test_bad_concurrency_is_refused() -> None:
    with pytest.raises(SystemExit):
        parse("--concurrency", "0")


def test_extract_tokenizer_makes_a_model_dir(tmp_path: Path) -> None:
    out = extract_tokenizer(tmp_path / "qwen3")
    assert (out / "tokenizer.json").stat().st_size > 1_000_000
    assert (out / "tokenizer_config.json").exists()
    assert (out / "config.json").read_text() == MODEL_CONFIG
