"""tools/plot_metrics.py: panels only for the metrics present, the plotted points are the records' (against
iterations or tokens), a resumed run's repeated iterations replace the earlier ones, runs overlaid with
their labels, and a real PNG comes out."""
import importlib.util
import json
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tool():
    spec = importlib.util.spec_from_file_location("plot_metrics", os.path.join(ROOT, "tools", "plot_metrics.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _train(it, loss, *, tokens=True, grad_norm=0.5):
    rec = {"type": "train", "iteration": it, "lm_loss": loss, "lr": 1e-3 / it, "grad_norm": grad_norm,
           "tokens_per_sec": 1000.0, "elapsed_ms": 512.0, "peak_memory_mib": 300.0 + it,
           "memory_label": "peak RSS", "consumed_samples": 4 * it, "global_batch_size": 4}
    if tokens:
        rec["consumed_tokens"] = 4 * 128 * it
    return rec


def _write(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _lines(ax):
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}


def test_panels_follow_the_metrics_present_and_points_equal_the_records(tmp_path):
    tool = _tool()
    # run a: bits per byte, logged 1..4, then resumed from iteration 2 (3 and 4 logged again, other losses)
    a = [_train(i, 5.0 - i) for i in (1, 2, 3, 4)]
    a += [{"type": "eval", "split": "validation", "iteration": 2, "val_loss": 3.5, "val_ppl": 33.1,
           "val_bits_per_byte": 1.9, "consumed_tokens": 1024}]
    a += [_train(3, 1.25), _train(4, 0.75)]
    # run b: an older file (no consumed_tokens, no grad norm, no bits per byte)
    b = [_train(i, 6.0 - i, tokens=False, grad_norm=None) for i in (2, 4)]
    b += [{"type": "eval", "split": "validation", "iteration": 4, "val_loss": 2.5, "val_ppl": 12.2}]
    pa, pb = _write(tmp_path / "a" / "metrics.jsonl", a), _write(tmp_path / "b" / "metrics.jsonl", b)
    runs = [tool.read_run(pa, "A"), tool.read_run(pb, "B")]
    assert [r["lm_loss"] for r in runs[0].train] == [4.0, 3.0, 1.25, 0.75]  # the resumed records replace

    fig = tool.build_figure(runs, axis="tokens")
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert titles == ["loss (train: line, validation: dots)", "validation bits per byte", "learning rate",
                      "gradient norm", "tokens/s (whole job)", "peak RSS (MiB)"]
    loss = _lines(fig.axes[0])
    assert loss["A"] == ([512, 1024, 1536, 2048], [4.0, 3.0, 1.25, 0.75])
    # b's tokens derived from tokens/s x time per iteration (1000 x 0.512 = 512 per iteration)
    assert loss["B"] == ([1024.0, 2048.0], [4.0, 2.0])
    assert loss["A (validation)"] == ([1024], [3.5]) and loss["B (validation)"] == ([2048.0], [2.5])
    assert set(_lines(fig.axes[1])) == {"A"}  # bits per byte: only the run that has it
    assert set(_lines(fig.axes[3])) == {"A"}  # gradient norm: b logged none

    fig = tool.build_figure(runs[1:], axis="iterations")
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert "validation bits per byte" not in titles and "gradient norm" not in titles
    assert _lines(fig.axes[0])["B"][0] == [2, 4]


def test_cli_writes_a_png_with_labels(tmp_path, capsys):
    tool = _tool()
    pa = _write(tmp_path / "a.jsonl", [_train(i, 5.0 / i) for i in range(1, 9)])
    pb = _write(tmp_path / "b.jsonl", [_train(i, 4.0 / i) for i in range(1, 9)])
    out = tmp_path / "plots" / "m.png"
    tool.main(["--metrics-file", pa, pb, "--label", "tp2", "dp4", "--x", "tokens", "--output", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image
    img = matplotlib.image.imread(str(out))
    assert img.shape[0] > 300 and img.shape[1] > 600 and float(np.std(img)) > 0.05  # drawn, not blank
    assert "wrote" in capsys.readouterr().out


def test_cli_refuses_bad_input_by_flag(tmp_path):
    tool = _tool()
    pa = _write(tmp_path / "a.jsonl", [_train(1, 1.0)])
    with pytest.raises(ValueError, match="--label needs one name per --metrics-file"):
        tool.main(["--metrics-file", pa, "--label", "x", "y", "--output", str(tmp_path / "o.png")])
    with pytest.raises(FileNotFoundError, match="--metrics-file .*missing.jsonl"):
        tool.main(["--metrics-file", str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "o.png")])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"type": "train", "iteration": 1, "lm_loss": 1.0}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl, line 2: not valid JSON"):
        tool.main(["--metrics-file", str(bad), "--output", str(tmp_path / "o.png")])
