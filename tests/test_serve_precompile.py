"""The server's kernel precompile (fastqwen/serve/precompile.py): scripts/precompile.py in a
subprocess for the server's settings, started before the weights load and waited for before the
slots launch anything; its failure or a hang never fails the start. Here the script is a stand-in
that records its arguments and takes a second (whether a GPU start then finds the kernels is the
GPU's measurement: `python -m bench startup`)."""
from __future__ import annotations

import json
import sys

import pytest

from fastqwen.serve import precompile


def _stand_in(tmp_path, body: str):
    script = tmp_path / "scripts" / "precompile.py"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text("import json, pathlib, sys, time\n" + body)
    return script


def test_the_command_is_the_servers_settings(tiny_model, monkeypatch):
    monkeypatch.delenv("FASTQWEN_SPECULATION", raising=False)
    m = str(tiny_model)
    limit = json.loads((tiny_model / "config.json").read_text())["max_position_embeddings"]
    argv = precompile.command(m, None, None, None, None, None)
    assert argv[:2] == [sys.executable, str(precompile.SCRIPT)]
    assert argv[2:] == ["--model", m, "--max-batch", "64", "--max-model-len", str(min(4096, limit)), "--block-size",
                        "0", "--speculation", "off", "--speculative-tokens", "4"]
    argv = precompile.command(m, 8, 512, 64, "auto", 3)
    assert argv[argv.index("--max-batch") + 1] == "8" and argv[argv.index("--max-model-len") + 1] == "512"
    assert argv[argv.index("--block-size") + 1] == "64" and argv[argv.index("--speculation") + 1] == "auto"
    assert argv[argv.index("--speculative-tokens") + 1] == "3"
    argv = precompile.command(m, 8, limit + 1000, 0, None, None)     # the server caps it at the model's limit too
    assert argv[argv.index("--max-model-len") + 1] == str(limit)
    monkeypatch.setenv("FASTQWEN_SPECULATION", "ngram")      # the engine's own default then
    assert precompile.command(m, 8, 512, 0, None, None)[-3] == "ngram"
    monkeypatch.setenv("FASTQWEN_SPECULATION", "mtp")        # not a server mode: nothing of it to compile
    assert precompile.command(m, 8, 512, 0, None, None)[-3] == "off"


def _on_sm90(monkeypatch):
    import torch

    monkeypatch.setattr(precompile, "wanted", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))


def test_a_start_that_finds_its_stamp_runs_no_precompile(tiny_model, tmp_path, monkeypatch):
    """The stamp a finished precompile leaves in the cache: a start of the same settings runs no
    subprocess; one of other settings runs its own."""
    import triton

    _on_sm90(monkeypatch)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(precompile, "SCRIPT", _stand_in(tmp_path, "print('captured 1 specializations')\n"))
    m = str(tiny_model)
    stamp = precompile.stamp_path(precompile.cache_dir(), m, precompile.settings(m, 2, 128, None, "off", 4),
                                  triton.__version__, 90)
    stamp.parent.mkdir(parents=True)
    stamp.write_text("{}")
    found = precompile.Precompile.start(m, 2, 128, None, "off", 4)
    assert found.proc is None and found.wait() == f"kernels precompiled already (stamp {stamp})"
    other = precompile.Precompile.start(m, 4, 128, None, "off", 4)
    assert other.proc is not None and other.wait().startswith("kernels precompiled in ")


def test_the_stamp_names_everything_the_kernels_depend_on(tiny_model, tmp_path, monkeypatch):
    """Another value of any input gives another stamp: the settings, Triton's version, the
    architecture, an engine variable, the checkpoint's config, an engine source's text."""
    m, cache = str(tiny_model), tmp_path / "cache"
    source = tmp_path / "engine" / "fq_x.py"
    source.parent.mkdir()
    source.write_text("A = 1\n")
    monkeypatch.setattr(precompile, "SCRIPT", tmp_path / "scripts" / "precompile.py")
    monkeypatch.setattr(precompile, "sources", lambda: [source])
    monkeypatch.delenv("FASTQWEN_NO_PDL", raising=False)
    settings = precompile.settings(m, 2, 128, None, "off", 4)

    def name(**change):
        args = {"settings": settings, "triton_version": "3.6.0", "arch": 90} | change
        return precompile.stamp_path(cache, m, **args).name

    first = name()
    assert name() == first and precompile.stamp_path(cache, m, settings, "3.6.0", 90).parent == cache / "fastqwen-precompiled"
    others = [name(settings=precompile.settings(m, 3, 128, None, "off", 4)), name(triton_version="3.1.0"),
              name(arch=100)]
    monkeypatch.setenv("FASTQWEN_NO_PDL", "1")
    others.append(name())
    monkeypatch.delenv("FASTQWEN_NO_PDL")
    source.write_text("A = 2\n")
    others.append(name())
    source.write_text("A = 1\n")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((tiny_model / "config.json").read_text() + " ")
    others.append(precompile.stamp_path(cache, str(model), settings, "3.6.0", 90).name)
    assert name() == first and len(set(others)) == len(others) and first not in others


def test_an_unreadable_config_leaves_the_error_to_the_engine(tmp_path, monkeypatch):
    monkeypatch.setattr(precompile, "wanted", lambda: True)
    assert precompile.Precompile.start(str(tmp_path), 1, 64, None, None, None) is None


def test_nothing_runs_where_no_gpu_compiles(monkeypatch):
    monkeypatch.setenv("FASTQWEN_BACKEND", "torch")
    assert not precompile.wanted() and precompile.Precompile.start("/m", 1, 64, None, None, None) is None


def test_the_server_waits_for_it_before_its_slots(tiny_model, tmp_path, monkeypatch):
    """The stand-in starts before the engine loads and ends after 4 s, longer than the tiny
    engine takes to load: the slots' memory plan finds it done, and the server keeps its summary."""
    from fastqwen.serve import app

    marker = tmp_path / "done.json"
    script = _stand_in(tmp_path, f"time.sleep(4.0)\n"
                                 f"pathlib.Path({str(marker)!r}).write_text(json.dumps(sys.argv[1:]))\n"
                                 "print('captured 3 specializations of 2 kernels in 0.1 s')\n"
                                 "print('compiled 3/3 into /c in 0.9 s wall (1.8 s of compiles, 2 threads)')\n")
    monkeypatch.setattr(precompile, "SCRIPT", script)
    _on_sm90(monkeypatch)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    engine_cls = app.engine_module().Engine
    plan = engine_cls.plan_slots
    seen = []

    def plan_slots(self, *args, **kwargs):
        seen.append(marker.is_file())
        return plan(self, *args, **kwargs)

    monkeypatch.setattr(engine_cls, "plan_slots", plan_slots)
    srv = app.Server(str(tiny_model), max_batch=2, max_model_len=128, served_model_name="tiny")
    try:
        assert seen == [True]
        argv = json.loads(marker.read_text())
        assert argv[argv.index("--model") + 1] == str(tiny_model) and argv[argv.index("--max-batch") + 1] == "2"
        assert srv.precompiled.startswith("kernels precompiled in ") and "compiled 3/3" in srv.precompiled
    finally:
        srv.close()


def test_a_failed_or_hung_precompile_never_fails_the_start(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr(precompile, "SCRIPT", _stand_in(tmp_path, "print('boom'); sys.exit(3)\n"))
    failed = precompile.Precompile(precompile.command(str(tiny_model), 1, 64, None, None, None))
    said = failed.wait()
    assert said.startswith("kernel precompile exited 3 after ") and said.endswith("(boom); the start compiles the rest")
    monkeypatch.setattr(precompile, "SCRIPT", _stand_in(tmp_path, "time.sleep(60)\n"))
    hung = precompile.Precompile(precompile.command(str(tiny_model), 1, 64, None, None, None))
    assert hung.wait(timeout=0.5) == "kernel precompile stopped after 0 s; the start compiles the rest"
    assert hung.proc.poll() is not None                        # stopped, not left running


@pytest.mark.parametrize("flag,expected", [([], True), (["--no-precompile"], False)])
def test_the_cli_passes_its_flag(flag, expected, tmp_path, monkeypatch):
    import argparse

    from fastqwen.serve import app, cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    got = {}
    monkeypatch.setattr(app, "serve", lambda *a, **kw: got.update(kw))
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    assert cli.run(parser.parse_args(["--model", str(tmp_path), *flag])) == 0
    assert got["precompile"] is expected


def test_the_server_loads_its_own_engine_whatever_else_is_named_engine(monkeypatch, tmp_path):
    """engine_module() loads the repository's engine/engine.py by its path: a module named `engine`
    imported earlier (here a stand-in, with its folder first on sys.path, as loading the native
    reference leaves a process) does not stand in for it."""
    import types

    from fastqwen.serve import app

    other = tmp_path / "other"
    other.mkdir()
    (other / "engine.py").write_text("class Engine:\n    pass\n")
    monkeypatch.syspath_prepend(str(other))
    monkeypatch.setitem(sys.modules, "engine", types.ModuleType("engine"))
    monkeypatch.delitem(sys.modules, app.ENGINE_MODULE, raising=False)
    module = app.engine_module()
    assert module.__file__.endswith("engine/engine.py") and hasattr(module.Engine, "plan_slots")
    assert app.engine_module() is module                       # once a process
