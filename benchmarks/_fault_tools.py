"""The tool and LoRA cells of benchmarks/fault_matrix.py (issue 31): the conversion tools, generation,
vocabulary adaptation, embedding propagation and LoRA, each given what a cluster or a user does to
it — overlapping paths, SIGTERM and SIGKILL while it writes, a rank killed or stopped while it
generates, a LoRA base moved or replaced, invalid adapter flags. A run must end (no hang), fail
where it has to (no silent wrong result), name the file or flag at fault on one line without a
traceback, and leave nothing that looks valid behind (the check after each run).

Each case is ``make(tw) -> Case``; :func:`run_tools` runs them with the matrix's ``launch`` and
``judge``.
"""
from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

from benchmarks.fault_matrix import REPO, Outcome, Run, Workspace, judge, launch, rank_pids
from tests.integration._train_helpers import without_flags

CONVERT = "tools/convert_checkpoint.py"
#: the layout column of a tool cell's Outcome
TOOL_LAYOUT = "tool"


@dataclass
class Case:
    script: str
    argv: list
    culprit: str                 # regex the output must match ("" when nothing can print: SIGKILL)
    expect: str = "error"        # "error" or "exit0"
    launcher: str = "python"
    nproc: int = 1
    during: Optional[Callable] = None
    after: Optional[Callable[[Run], str]] = None   # "" when what is left behind is right, else why


class ToolWorkspace:
    """A ~20M-parameter Llama (80 MB, so that its conversions take long enough to be interrupted) with
    the old tokenizer of an adaptation, the new tokenizer, and what the tools make from them, built
    once by clean runs; ``ws`` is the matrix's training workspace (LoRA cells)."""

    def __init__(self, ws: Workspace) -> None:
        from tests.fixtures.models import tiny_llama
        from tests.fixtures.tokenizers import adaptation_tokenizers
        self.ws = ws
        self.root = os.path.join(ws.root, "tools")
        self.runs = os.path.join(self.root, "runs")
        os.makedirs(self.runs, exist_ok=True)
        self.hf = os.path.join(self.root, "hf")
        if not os.path.isfile(os.path.join(self.hf, "config.json")):
            from megatron_ru.data.tokenizer import GPTSentencePieceTokenizer
            old_sp, self.new_sp, tok_dir = adaptation_tokenizers(self.root)
            old = GPTSentencePieceTokenizer(old_sp)
            tiny_llama(self.hf, vocab_size=old.vocab_size, hidden=512, layers=8, heads=8, kv_heads=4, ffn=1024,
                       tokenizer_dir=tok_dir, eos_token_id=old.eod)
        else:
            self.new_sp = adaptation_tokenizers(self.root)[1]
        self.ckpt = self._made("ckpt_tp2", [CONVERT, "import-hf", "--load", self.hf, "--save", "{out}",
                                            "--target-tensor-parallel-size", "2"])
        self.adapted = self._made("adapted", ["tools/adapt_vocab.py", "--model", self.hf, "--new-tokenizer",
                                              self.new_sp, "--save", "{out}"])

    def _made(self, name: str, argv: list) -> str:
        out = os.path.join(self.root, name)
        if not os.path.isdir(out):
            proc = subprocess.run([sys.executable, *[a.replace("{out}", out) for a in argv]], cwd=REPO,
                                  env=_env(), capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                raise RuntimeError(f"could not make {name}:\n{proc.stderr[-3000:]}")
        return out

    def fresh(self, name: str) -> str:
        path = os.path.join(self.runs, name)
        shutil.rmtree(path, ignore_errors=True)
        for stale in glob.glob(path + ".*"):
            shutil.rmtree(stale, ignore_errors=True)
        return path


def _env() -> dict:
    return {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}


def _leftovers(save: str) -> list[str]:
    """Everything under ``save``'s name: the output itself and temporaries next to it."""
    return sorted(p for p in glob.glob(save + "*") if p == save or os.path.basename(p).startswith(
        os.path.basename(save) + "."))


# ---- overlapping paths ----------------------------------------------------------------------

def _untouched(path: str, marker: str) -> Callable[[Run], str]:
    before = sorted(os.listdir(path))

    def after(run: Run) -> str:
        if not os.path.exists(os.path.join(path, marker)):
            return f"the input {path} lost {marker}"
        extra = sorted(set(os.listdir(path)) - set(before))
        return f"the input {path} gained {extra}" if extra else ""
    return after


def overlap(tool: str):
    def make(tw: ToolWorkspace) -> Case:
        if tool == "import-hf":  # --save inside --load
            argv = [CONVERT, "import-hf", "--load", tw.hf, "--save", os.path.join(tw.hf, "megatron")]
            return Case(argv[0], argv[1:], "overlap", after=_untouched(tw.hf, "config.json"))
        if tool == "export-hf":
            argv = [CONVERT, "export-hf", "--load", tw.ckpt, "--save", os.path.join(tw.ckpt, "hf")]
            return Case(argv[0], argv[1:], "overlap", after=_untouched(tw.ckpt, "latest_checkpointed_iteration.txt"))
        if tool == "reshard":  # the case: --save is the input's parent, with --force
            parent = tw.fresh("reshard_parent")
            run1 = os.path.join(parent, "run1")
            shutil.copytree(tw.ckpt, run1)
            argv = [CONVERT, "reshard", "--load", run1, "--save", parent, "--force",
                    "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "2"]
            return Case(argv[0], argv[1:], "overlap", after=_untouched(run1, "latest_checkpointed_iteration.txt"))
        if tool == "adapt_vocab":
            argv = ["tools/adapt_vocab.py", "--model", tw.hf, "--new-tokenizer", tw.new_sp, "--save",
                    os.path.dirname(tw.hf), "--force"]
            return Case(argv[0], argv[1:], "overlap", after=_untouched(tw.hf, "config.json"))
        argv = ["tools/propagate_embeddings.py", "--base", tw.hf, "--adapted", tw.adapted, "--instruct", tw.hf,
                "--save", os.path.join(tw.adapted, "lep")]
        return Case(argv[0], argv[1:], "overlap", after=_untouched(tw.adapted, "config.json"))
    return make


# ---- a signal while the output is written -----------------------------------------------------

def _writer(tw: ToolWorkspace, tool: str, save: str) -> list:
    if tool == "import-hf":
        return [CONVERT, "import-hf", "--load", tw.hf, "--save", save, "--target-tensor-parallel-size", "2"]
    if tool == "export-hf":
        return [CONVERT, "export-hf", "--load", tw.ckpt, "--save", save]
    if tool == "reshard":
        return [CONVERT, "reshard", "--load", tw.ckpt, "--save", save, "--target-tensor-parallel-size", "1",
                "--target-pipeline-parallel-size", "2"]
    if tool == "adapt_vocab":
        return ["tools/adapt_vocab.py", "--model", tw.hf, "--new-tokenizer", tw.new_sp, "--save", save]
    return ["tools/propagate_embeddings.py", "--base", tw.hf, "--adapted", tw.adapted, "--instruct", tw.hf,
            "--save", save]


def signal_mid_write(tool: str, sig: int):
    """``sig`` as soon as the tool's temporary output exists. SIGTERM: exit 143, nothing left. SIGKILL:
    nothing under the output's name but the dead writer's temporary, which the next run with the same
    ``--save`` removes before it writes a complete output."""
    def make(tw: ToolWorkspace) -> Case:
        save = tw.fresh(f"{tool}-{signal.Signals(sig).name}")
        argv = _writer(tw, tool, save)

        def during(proc, started):
            deadline = time.time() + 300
            while time.time() < deadline and proc.poll() is None:
                if any(".tmp-" in p for p in _leftovers(save)):
                    os.kill(proc.pid, sig)
                    return {"injected": True, "injected_at": time.time() - started}
                time.sleep(0.005)
            return {"injected": False}

        def after(run: Run) -> str:
            left = _leftovers(save)
            if os.path.exists(save):
                return f"{save} exists after the signal"
            if sig == signal.SIGTERM:
                return f"left behind: {left}" if left else ""
            again = subprocess.run([sys.executable, *argv], cwd=REPO, env=_env(), capture_output=True, text=True,
                                   timeout=600)
            if again.returncode != 0:
                return f"the next run failed: {again.stderr[-500:]}"
            left = _leftovers(save)
            return "" if left == [save] else f"after the next run: {left}"
        culprit = "SIGTERM" if sig == signal.SIGTERM else ""
        return Case(argv[0], argv[1:], culprit, during=during, after=after)
    return make


# ---- generation: a rank killed or stopped -----------------------------------------------------

def generation_fault(launcher: str, rank: int, sig: int):
    def make(tw: ToolWorkspace) -> Case:
        argv = ["--load", tw.hf, "--tensor-model-parallel-size", "2", "--prompt", "the", "--greedy",
                "--max-new-tokens", "100000", "--no-kv-cache", "--distributed-timeout-minutes",
                str(tw.ws.timeout_minutes)]

        def during(proc, started):
            deadline = time.time() + 240
            while time.time() < deadline and proc.poll() is None:  # both ranks past start-up
                pids = rank_pids(proc.pid, "generate.py")
                if len(pids) == 2:
                    time.sleep(25)
                    if proc.poll() is None and rank in rank_pids(proc.pid, "generate.py"):
                        os.kill(pids[rank], sig)
                        return {"injected": True, "injected_at": time.time() - started}
                time.sleep(0.2)
            return {"injected": False}
        return Case("tools/generate.py", argv, r"rank|peer|timed out|closed|died|signal", launcher=launcher,
                    nproc=2, during=during)
    return make


def generate_missing_load(tw: ToolWorkspace) -> Case:
    return Case("tools/generate.py", ["--load", os.path.join(tw.runs, "no_such_model"), "--prompt", "x"],
                "no_such_model")


# ---- LoRA: the base moved or replaced; invalid flags -----------------------------------------

def _lora(tw: ToolWorkspace) -> tuple[str, str, list]:
    """(base, lora checkpoint, the resume's argv): the matrix's TP 2 x PP 2 base, a LoRA run of 2
    iterations on it (torchrun, once)."""
    ws, layout = tw.ws, "tp2pp2"
    base = os.path.join(tw.root, "lora_base")
    lora = os.path.join(tw.root, "lora")
    if not os.path.isdir(base):
        shutil.copytree(ws.base_checkpoint(layout), base)
    resume = ws.argv(layout, iters=4, extra=("--lora-rank", "4", "--load", lora, "--save", lora))
    if not os.path.isfile(os.path.join(lora, "latest_checkpointed_iteration.txt")):
        first = ws.argv(layout, iters=4, extra=("--lora-rank", "4", "--load", base, "--finetune", "--save", lora,
                                                "--exit-interval", "2"))
        run = launch("torchrun", first, limit=600)
        if run.rc != 0:
            raise RuntimeError(f"could not make the LoRA checkpoint:\n{run.output[-3000:]}")
    return base, lora, resume


def _other_base(tw: ToolWorkspace) -> str:
    """A checkpoint of the same shape as the LoRA base, other weights (another seed)."""
    other = os.path.join(tw.root, "other_base")
    if not os.path.isfile(os.path.join(other, "latest_checkpointed_iteration.txt")):
        argv = without_flags(tw.ws.argv("tp2pp2", iters=6, extra=("--save", other, "--exit-interval", "2")),
                             "--seed") + ["--seed", "8"]
        run = launch("torchrun", argv, limit=600)
        if run.rc != 0:
            raise RuntimeError(f"could not make the other base:\n{run.output[-3000:]}")
    return other


def lora_base(change: str, tool: str):
    """The LoRA checkpoint's base moved away, or replaced by another model of the same shape; then a
    LoRA resume (``tool`` = "resume") or ``export-hf --lora merge`` must refuse, naming the base. The
    base is put back after the run."""
    def make(tw: ToolWorkspace) -> Case:
        base, lora, resume = _lora(tw)
        aside = base + ".aside"
        if os.path.isdir(aside):  # an earlier run was interrupted
            shutil.rmtree(base, ignore_errors=True)
            os.rename(aside, base)
        os.rename(base, aside)
        if change == "replaced":
            shutil.copytree(_other_base(tw), base)
        culprit = "is not that base" if change == "replaced" else r"lora_base"
        out = tw.fresh(f"lora-merge-{change}")

        def after(run: Run) -> str:
            shutil.rmtree(base, ignore_errors=True)
            os.rename(aside, base)
            return f"{out} was written" if tool == "export" and _leftovers(out) else ""
        if tool == "resume":
            return Case("pretrain_gpt.py", resume, culprit, launcher="torchrun", nproc=4, after=after)
        return Case(CONVERT, ["export-hf", "--load", lora, "--save", out, "--lora", "merge"], culprit, after=after)
    return make


def lora_flags(flags: list, culprit: str):
    def make(tw: ToolWorkspace) -> Case:
        base, _, _ = _lora(tw)
        argv = tw.ws.argv("tp2pp2", iters=4, extra=("--load", base, "--finetune", *flags))
        # under mpirun, whose exit status is the ranks' (torchrun's is 1 for any failed worker)
        return Case("pretrain_gpt.py", argv, culprit, launcher="mpirun", nproc=4,
                    after=lambda run: "" if run.rc == 2 else f"exit {run.rc}, not 2")
    return make


TOOL_FAULTS: dict[str, Callable[[ToolWorkspace], Case]] = {
    **{f"{t}: --save overlaps an input": overlap(t)
       for t in ("import-hf", "export-hf", "reshard", "adapt_vocab", "propagate_embeddings")},
    **{f"{t}: {s.name} while writing": signal_mid_write(t, s)
       for t in ("import-hf", "export-hf", "reshard", "adapt_vocab", "propagate_embeddings")
       for s in (signal.SIGTERM, signal.SIGKILL)},
    **{f"generate TP 2 ({lau}): rank {r} {'killed' if s == signal.SIGKILL else 'stopped'}":
       generation_fault(lau, r, s)
       for lau in ("torchrun", "mpirun") for r in (0, 1) for s in (signal.SIGKILL, signal.SIGSTOP)},
    "generate: --load does not exist": generate_missing_load,
    "LoRA resume: base moved": lora_base("moved", "resume"),
    "LoRA resume: base replaced (same shape)": lora_base("replaced", "resume"),
    "LoRA merge: base replaced (same shape)": lora_base("replaced", "export"),
    "LoRA: --lora-alpha 0": lora_flags(["--lora-rank", "4", "--lora-alpha", "0"], r"--lora-alpha"),
    "LoRA: --lora-alpha 8 without a positive --lora-rank": lora_flags(["--lora-alpha", "8"], r"--lora-rank"),
}


def tool_table(outcomes: list) -> str:
    """The docs table of the tool cells: exit status, seconds, verdict."""
    rows = ["| tool and fault | launcher | exit, seconds | verdict |", "|---|---|---|---|"]
    for o in outcomes:
        if o.layout == TOOL_LAYOUT:
            rows.append(f"| {o.fault} | {o.launcher} | {o.rc if not o.hang else 'HANG'}, {o.seconds:.0f} s | "
                        f"{'ok' if o.ok else '**FAIL** ' + o.note} |")
    return "\n".join(rows)


def run_tools(ws: Workspace, names: list, startup_s: float) -> list:
    tw = ToolWorkspace(ws)
    out = []
    for name in names:
        try:
            case = TOOL_FAULTS[name](tw)
        except (OSError, RuntimeError, IndexError) as e:
            out.append(Outcome("python", TOOL_LAYOUT, name, "error", None, 0.0, False, False, False, 0, 0, False,
                               f"fault not set up: {type(e).__name__}: {e}"))
            print(f"FAIL tools {name:52s} not set up: {e}", flush=True)
            continue
        limit = startup_s + ws.timeout_minutes * 60 + 90
        run = launch(case.launcher, case.argv, limit, case.during, nproc=case.nproc, script=case.script)
        o = judge(case.launcher, TOOL_LAYOUT, name, case.expect, case.culprit, run)
        if case.after is not None and not run.hang and run.extra.get("injected", True):
            problem = case.after(run)
            if problem:
                o.ok, o.note = False, problem
        print(f"{'ok  ' if o.ok else 'FAIL'} {case.launcher:8s} {name:52s} rc={o.rc} {o.seconds:6.1f}s "
              f"errors={o.error_lines} tracebacks={o.tracebacks} {o.note}", flush=True)
        out.append(o)
    return out
