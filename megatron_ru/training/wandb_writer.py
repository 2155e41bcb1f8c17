"""Weights & Biases as a second scalar sink next to TensorBoard (Megatron's ``--wandb-project``,
``--wandb-exp-name``, ``--wandb-save-dir``).

It receives exactly the :class:`~megatron_ru.training.metrics.Scalars` TensorBoard receives, logged at
``step = iteration``; the scalars TensorBoard puts on the consumed-samples axis
(``train/lm_loss_vs_samples``) get ``train/consumed_samples`` as their W&B step metric, so both tools
plot the same points. wandb is optional: it is imported only when a W&B flag is given, and a missing
package is refused by name at validation (``LoggingConfig.problems``) and here. Any W&B flag starts the
run (Megatron-DeepSpeed's forks start one from ``--wandb-name`` alone); the project is --wandb-project,
else WANDB_PROJECT, else W&B's default name (:func:`wandb_project`), and the banner says which.

The run does not capture the console (``console="off"``: our log lines stay ours) and says nothing
itself (``silent``); its directory is logged once. ``WANDB_MODE=offline`` (no network, e.g. on compute
nodes) writes ``<dir>/wandb/offline-run-*/run-*.wandb`` for a later ``wandb sync``.
"""
from __future__ import annotations

import os
from typing import Any, Mapping, Optional

from megatron_ru.training.metrics import SAMPLES_TAG, VS_SAMPLES_TAGS, Scalars
from megatron_ru.utils.logging import get_logger

log = get_logger(__name__)


def import_wandb() -> Any:
    try:
        import wandb
    except ImportError as e:
        raise ValueError("the W&B flags (--wandb-project, --wandb-exp-name/--wandb-name, --wandb-id, "
                         "--wandb-save-dir) need the wandb package: pip install wandb (or leave them out)") from e
    return wandb


#: the project of a run given no --wandb-project and no WANDB_PROJECT: W&B's own default name
DEFAULT_PROJECT = "uncategorized"


def wandb_project(flag: Optional[str], environ: Optional[Mapping[str, str]] = None) -> tuple[str, str]:
    """The W&B project of this run and where it came from: --wandb-project, else the WANDB_PROJECT
    environment variable (W&B's convention), else :data:`DEFAULT_PROJECT`. Megatron-DeepSpeed's forks
    start a run from --wandb-name alone and leave the project to W&B; their job scripts run unchanged."""
    env = os.environ if environ is None else environ
    if flag:
        return flag, "--wandb-project"
    if env.get("WANDB_PROJECT"):
        return env["WANDB_PROJECT"], "WANDB_PROJECT"
    return DEFAULT_PROJECT, "no --wandb-project nor WANDB_PROJECT: W&B's default"


def wandb_dir(wandb_save_dir: Optional[str], save: Optional[str]) -> str:
    """Where the run files go: --wandb-save-dir, else ``<--save>/wandb`` (Megatron's default), else ./wandb."""
    if wandb_save_dir:
        return wandb_save_dir
    if save:
        return os.path.join(save, "wandb")
    return os.path.abspath("wandb")


class WandbSink:
    """One W&B run of this process (global rank 0 only: see :class:`MetricsWriter`)."""

    def __init__(self, project: Optional[str], exp_name: Optional[str], wandb_save_dir: Optional[str],
                 save: Optional[str], run_config: Optional[dict[str, Any]] = None,
                 run_id: Optional[str] = None) -> None:
        wandb = import_wandb()
        project, source = wandb_project(project)
        directory = wandb_dir(wandb_save_dir, save)
        os.makedirs(directory, exist_ok=True)
        try:
            # --wandb-id: the same W&B run continues (a resumed job's curves join the earlier ones)
            resume = {"id": run_id, "resume": "allow"} if run_id else {}
            self._run = wandb.init(project=project, name=exp_name, dir=directory, config=run_config or {},
                                   settings=wandb.Settings(console="off", silent=True), **resume)
        except Exception as e:  # noqa: BLE001 - wandb's own error types vary by version
            raise ValueError(f"Weights & Biases could not start a run in project {project} ({source}): "
                             f"{type(e).__name__}: {e} Log in (`wandb login` or WANDB_API_KEY), or set "
                             f"WANDB_MODE=offline to write the run files under {directory} for a later "
                             f"`wandb sync`") from e
        self._run.define_metric(SAMPLES_TAG)
        self._vs_samples: set[str] = set()  # the "... vs samples" tags defined so far (on their first write)
        log.info(f"Weights & Biases: project {project} ({source}), run {self._run.name} ({self._run.id}), "
                 f"{'offline, ' if getattr(self._run.settings, 'mode', '') == 'offline' else ''}run files in "
                 f"{os.path.dirname(self._run.dir)}")

    def write(self, scalars: Scalars) -> None:
        for tag in scalars.values.keys() & (set(VS_SAMPLES_TAGS) - self._vs_samples):
            # the x axis of a "... vs samples" curve is the consumed samples; defined for the tags this run
            # writes (the Megatron switches that are off leave no empty charts)
            self._run.define_metric(tag, step_metric=SAMPLES_TAG)
            self._vs_samples.add(tag)
        self._run.log(dict(scalars.values), step=scalars.iteration)

    def close(self) -> None:
        self._run.finish()
