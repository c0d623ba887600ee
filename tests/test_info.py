"""``vtp-runtime info`` and ``VTP_DEBUG`` selection logging."""

import io
import json
import logging
import subprocess
import sys

import pytest
import torch

import vtp_runtime as vtp
from vtp_runtime import cli, dispatch, info
from vtp_runtime.backend import Backend, OpCapability
from vtp_runtime.ops import OPS
from vtp_runtime.registry import REGISTRY, hookimpl, registered


class Picky(Backend):
    """Only TP 1, even shards, fp32 entropy: an easy target for --explain reasons."""

    name = "info_picky"
    priority = -40
    ops = {
        "entropy": OpCapability(
            device_types=frozenset({"cpu"}),
            dtypes=frozenset({torch.float32}),
            tp_sizes=frozenset({1}),
            even_shards_only=True,
        )
    }


class PickyPlugin:
    @hookimpl
    def vtp_runtime_register_backends(self, register):
        register(Picky())


@pytest.fixture
def picky():
    with registered(PickyPlugin(), name="picky-plugin") as record:
        yield record


def main(capsys, *argv):
    rc = cli.main(["info", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_plain_text(capsys, picky):
    rc, out, _ = main(capsys)
    assert rc == 0
    for section in ("versions:", "devices:", "plugins:", "backends on cpu", "why not:"):
        assert section in out
    assert "torch" in out and torch.__version__.split("+")[0] in out and "liger-kernel" in out
    assert "intel-extension-for-pytorch" in out
    width = 2 + len(OPS)  # name, priority, one column per op (the losses, argmax, sample)
    rows = {
        ln.split()[0]: ln.split()[1:] for ln in out.splitlines() if ln.startswith("  ") and len(ln.split()) == width
    }
    assert rows["eager"] == ["0"] + ["yes"] * len(OPS)
    assert rows["info_picky"] == ["-40", "-", "-", "yes", "-", "-", "-", "-"]
    assert any(ln.split()[:2] == ["loaded", "picky-plugin"] for ln in out.splitlines())
    assert "\x1b[" not in out  # not a terminal: no rich markup


def test_json(capsys, picky):
    rc, out, _ = main(capsys, "--json")
    data = json.loads(out)
    # the distribution's version: "2.13.0+cpu" for the CPU build, "2.13.0" for the CUDA one
    assert rc == 0 and data["versions"]["torch"] in (torch.__version__, torch.__version__.split("+")[0])
    assert data["device_type"] == "cpu" and data["devices"][0]["type"] == "cpu"
    assert set(data["backends"]) == set(REGISTRY.backends())
    eager = data["backends"]["eager"]
    assert eager["source"].startswith("vtp-runtime") and all(eager["ops"][op]["available"] for op in OPS)
    assert data["backends"]["info_picky"]["ops"]["entropy"]["tp_sizes"] == [1]
    assert data["backends"]["info_picky"]["ops"]["kl"] == {
        "implemented": False,
        "available": False,
        "reasons": ["does not implement kl"],
    }
    assert {"name": "picky-plugin", "status": "loaded"}.items() <= next(
        p for p in data["plugins"] if p["name"] == "picky-plugin"
    ).items()


def test_rich_tables(picky):
    from rich.console import Console

    buf = io.StringIO()
    info.render_rich(info.collect(), Console(file=buf, force_terminal=True, width=160))
    text = buf.getvalue()
    assert "backends x ops on cpu" in text and "info_picky" in text and "\x1b[" in text


def test_explain_simulated_tp_call(capsys, picky):
    rc, out, _ = main(capsys, "--explain", "entropy", "--dtype", "bf16", "--vocab", "151937", "--tp", "2")
    assert rc == 0
    assert "op=entropy device=cpu dtype=bfloat16 tp=2 V=151937 tokens=1024 shards=uneven" in out
    expected = dispatch.explain_request(info.simulated_request("entropy", torch.bfloat16, 151937, 2), None).backend
    assert f"selected: {expected}" in out and expected is not None
    block = out.split("`info_picky` is not supported because:")[1].split("`")[0]
    assert "TP size 2 not supported" in block and "needs even vocabulary shards" in block
    assert "dtype bfloat16 not supported" in block
    for name in REGISTRY.backends():  # every backend gets a verdict
        assert f"`{name}`" in out


def test_explain_json_and_forcing(capsys, picky):
    rc, out, _ = main(
        capsys,
        "--explain",
        "entropy",
        "--dtype",
        "fp32",
        "--vocab",
        "1000",
        "--tp",
        "1",
        "--backend",
        "info_picky",
        "--json",
    )
    data = json.loads(out)
    assert rc == 0 and data["selected"] == "info_picky" and data["forced"] == "info_picky"
    assert data["request"]["even_shards"] is True and data["reasons"]["info_picky"] == []

    rc, out, _ = main(
        capsys,
        "--explain",
        "entropy",
        "--vocab",
        "1000",
        "--tp",
        "4",
        "--uneven",
        "--feature",
        "temperature",
        "--backend",
        "info_picky",
    )
    assert rc == 1 and "selected: none" in out and "does not support temperature" in out

    rc, _, err = main(capsys, "--explain", "entropy", "--backend", "no_such_backend")
    assert rc == 2 and "unknown backend 'no_such_backend'" in err and "eager" in err


def test_simulated_request():
    r = info.simulated_request("jsd", torch.bfloat16, 151936, 2)
    assert r.even_shards and not r.empty_shard and r.tp_size == 2 and r.num_tokens == 1024
    assert not info.simulated_request("jsd", torch.bfloat16, 151937, 2).even_shards
    assert not info.simulated_request("jsd", torch.bfloat16, 151936, 2, uneven=True).even_shards
    with pytest.raises(ValueError, match="unknown op"):
        info.simulated_request("nope", torch.float32, 10, 1)


def test_module_entry_point():
    done = subprocess.run(
        [sys.executable, "-m", "vtp_runtime", "info", "--explain", "kl", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["selected"] is not None


# -- VTP_DEBUG -----------------------------------------------------------------------------


def test_debug_logs_each_selection_once(monkeypatch, caplog):
    monkeypatch.setenv("VTP_DEBUG", "1")
    dispatch.clear_selections()  # what other tests logged
    v = 29
    chosen = vtp.explain("entropy", torch.randn(3, v)).backend  # eager, or triton under TRITON_INTERPRET=1
    with caplog.at_level(logging.DEBUG, logger="vtp_runtime"):
        for n in (3, 4, 5, 3):  # token counts do not make a new signature
            vtp.entropy(torch.randn(n, v))
        records = [r for r in caplog.records if "[VTP_DEBUG]" in r.getMessage()]
        assert len(records) == 1
        msg = records[0].getMessage()
        assert msg.startswith(f"vtp_runtime selected {chosen} for entropy")
        assert f"V={v}" in msg and f"selected: {chosen}" in msg
        for name in REGISTRY.backends():  # every candidate, with its reasons or its standing
            assert f"`{name}`" in msg
        vtp.entropy(torch.randn(0, v))  # zero tokens: capabilities may differ, a new signature
        vtp.entropy(torch.randn(3, v), temperature=2.0)  # a feature
        vtp.entropy(torch.randn(3, v), backend="eager")  # forced
        vtp.kl(torch.randn(3, v), torch.randn(3, v))  # another op
        vtp.kl(torch.randn(3, v), torch.randn(3, v))
        records = [r for r in caplog.records if "[VTP_DEBUG]" in r.getMessage()]
        assert len(records) == 5
        assert "forced: eager (by the backend= argument)" in records[3].getMessage()


def test_debug_off_logs_nothing(monkeypatch, caplog):
    monkeypatch.delenv("VTP_DEBUG", raising=False)
    dispatch.clear_selections()  # a call no test logged yet would log, were VTP_DEBUG on
    with caplog.at_level(logging.DEBUG, logger="vtp_runtime"):
        vtp.entropy(torch.randn(3, 31))
    assert not [r for r in caplog.records if "[VTP_DEBUG]" in r.getMessage()]


def test_explain_head_inputs(capsys, picky):
    rc, out, _ = main(capsys, "--explain", "entropy", "--dtype", "fp32", "--vocab", "1000", "--head")
    assert rc == 0 and "inputs=head" in out
    block = out.split("`info_picky` is not supported because:")[1].split("`")[0]
    assert "head inputs not supported" in block
    rc, out, _ = main(capsys, "--explain", "cross_entropy", "--vocab", "1000", "--head", "per-token", "--json")
    data = json.loads(out)
    assert data["request"]["head_inputs"] and data["request"]["head_per_token"]
    assert any("per-token result not supported" in r for r in data["reasons"]["liger"])
    r = info.simulated_request("jsd", torch.bfloat16, 1000, 2, head="scalar")
    assert r.head_inputs and not r.head_per_token
