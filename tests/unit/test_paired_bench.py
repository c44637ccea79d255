"""bench/paired_bench.py: sides parsed from their specs, each side's rows read back from the JSON that
``smg-bench gateway --json`` writes, and the window-by-window ratios of the first side to the others."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest

from shepherd.loadgen.report import RunRow

ROOT = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("paired_bench", ROOT / "bench" / "paired_bench.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["paired_bench"] = module  # (dataclasses look their module up while the class is made)
    spec.loader.exec_module(module)
    return module


pb = _load()


def _row(target: str, conc: int, cpu: float, ok: int = 100) -> RunRow:
    nan = math.nan
    return RunRow(
        "stream", target, conc, ok, 10.0, ok / 10.0, nan, nan, nan, nan, nan, nan, cpu, 500.0, 3, 4.0, 2.0
    )


def test_a_side_spec_names_its_target_tree_args_and_environment(tmp_path: Path) -> None:
    side = pb.parse_side(f"old=node,tree={tmp_path},SHEPHERD_X=1,args=--node-args '--procs 2'")
    assert (side.name, side.target, side.tree) == ("old", "node", tmp_path.resolve())
    assert side.env == {"SHEPHERD_X": "1"}
    assert side.args == ("--node-args", "--procs 2")
    env = side.environ()
    assert env["PYTHONPATH"] == str(tmp_path.resolve()) and env["SHEPHERD_X"] == "1"
    assert side.root == tmp_path.resolve()  # (``python -m`` looks in the working directory first)
    assert pb.parse_side("new=node").root == ROOT
    cmd = side.command(["--rounds", "3"], tmp_path / "old.json")
    assert cmd[-6:] == ["--node-args", "--procs 2", "--targets", "node", "--json", str(tmp_path / "old.json")]
    assert "--rounds" in cmd
    peer = pb.parse_side("ref=smg").command([], tmp_path / "ref.json")
    assert peer[-5:-2] == ["", "--peers", "smg"]  # no node of its own: the peer only


def test_a_side_can_run_under_another_interpreter(tmp_path: Path) -> None:
    side = pb.parse_side("deb=node,python=/usr/bin/python3.11")
    assert side.python == "/usr/bin/python3.11" and side.env == {}
    assert side.command([], tmp_path / "deb.json")[0] == "/usr/bin/python3.11"
    assert pb.parse_side("here=node").command([], tmp_path / "here.json")[0] == sys.executable
    assert "python /usr/bin/python3.11" in pb._describe(side)


@pytest.mark.parametrize("spec", ["node", "a=", "=node", "a=nginx", "a=node,novalue"])
def test_bad_side_specs_are_refused(spec: str) -> None:
    with pytest.raises(ValueError):
        pb.parse_side(spec)


def test_two_sides_of_one_name_are_refused() -> None:
    with pytest.raises(ValueError, match="one name"):
        pb.check_names([pb.parse_side("a=node"), pb.parse_side("a=node,tree=/tmp")])
    pb.check_names([pb.parse_side("node=node"), pb.parse_side("node2=node")])


def test_rows_round_trip_through_the_json_the_gateway_bench_writes(tmp_path: Path) -> None:
    rows = [_row("node", 32, 3.0), replace(_row("node", 128, math.nan), errors={"timeout": 2})]
    path = tmp_path / "side.json"
    path.write_text(json.dumps({"benchmark": "gateway", "rows": [r.to_json() for r in rows]}))
    back = pb.load_rows(path, "new")
    assert [r.target for r in back] == ["new", "new"]
    assert back[0].gateway_cpu_ms == 3.0 and back[0].concurrency == 32
    assert math.isnan(back[1].gateway_cpu_ms) and math.isnan(back[1].p50_ms)  # None in the file
    assert back[1].errors == {"timeout": 2}


def test_the_report_pairs_each_window_of_the_first_side_with_the_same_window_of_the_others() -> None:
    # (names that start alike are still told apart: "node" is not "node2")
    new = [_row("node", 32, 2.0), _row("node", 32, 4.0), _row("node", 128, 3.0)]
    old = [_row("node2", 32, 2.5), _row("node2", 32, 5.0), _row("node2", 128, 3.0, ok=50)]
    lines = pb.paired_report("node", {"node": new, "node2": old})
    assert lines[0] == "== stream"
    ratios = [line for line in lines if line.startswith("c=")]
    assert ratios == [
        "c=32 node/node2 CPU per request: 0.80 0.80 (median 0.80, pooled 0.80)",
        "c=128 node/node2 CPU per request: 1.00 (median 1.00, pooled 1.00)",
    ]
