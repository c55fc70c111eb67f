"""The run's metric sinks side by side: TensorBoard + JSONL (`metrics.MetricsWriter`) and,
when ``config.logging.wandb.enable``, Weights & Biases.

    writer = open_writers(spec, workdir, resume_step=...)  # the trainer's only writer
    writer.write_scalars(step, scalars); writer.write_texts(step, texts); writer.flush()

Every sink has the same four methods (the interface of clu's ``MetricWriter``, which is not a
dependency here: a fan-out over two sinks is a loop). wandb is imported only when enabled.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence


from dapo_jax.infra import run_files
from dapo_jax.infra.metrics import MetricsWriter

if TYPE_CHECKING:  # run_spec imports config, which imports this module
  from dapo_jax.spec.run_spec import RunSpec

_log = logging.getLogger(__name__)

WANDB_MODES = ("online", "offline", "disabled")
RUN_ID_FILE = "wandb_run_id"  # in the workdir: a resumed run continues the same wandb run
_MISSING = ("config.logging.wandb.enable=True needs the wandb package: pip install wandb "
            "(or set --config.logging.wandb.enable=False).")


def wandb_tags(tags: str | Sequence[str]) -> list[str]:
  """``"a,b"`` (handy on the command line) or a list -> ``["a", "b"]``."""
  items = tags.split(",") if isinstance(tags, str) else list(tags)
  return [str(t).strip() for t in items if str(t).strip()]


def _import_wandb():
  try:
    import wandb  # pylint: disable=g-import-not-at-top
  except ImportError as err:
    raise ImportError(_MISSING) from err
  return wandb


class WandbWriter:
  """Scalars (one wandb row per step) and sample texts (a table per logged step) to a wandb run.

  Args:
    workdir: the run directory; it keeps the wandb run id, so a restart resumes the same run
      (wandb's own files go to ``$WANDB_DIR``, default ``./wandb``, as wandb decides).
    project, entity, name, mode, tags: `wandb.init` arguments ("" = wandb's default).
    config: the run config, shown in the wandb UI.
    texts_every: log sample texts on steps divisible by this (a table is an upload each time).
    active: default ``jax.process_index() == 0``; other processes create no run.
  """

  def __init__(self, workdir: str | os.PathLike, *, project: str, entity: str = "",
               name: str = "", mode: str = "online", tags: str | Sequence[str] = (),
               config: Mapping[str, Any] | None = None, texts_every: int = 1,
               active: bool | None = None):
    if active is None:
      import jax  # pylint: disable=g-import-not-at-top
      active = jax.process_index() == 0
    self.active, self.texts_every, self.run = active, max(int(texts_every), 1), None
    if not active:
      return
    wandb = _import_wandb()
    self._table = wandb.Table
    from etils import epath  # pylint: disable=g-import-not-at-top
    id_file = epath.Path(os.fspath(workdir)) / RUN_ID_FILE
    run_id = id_file.read_text().strip() if id_file.exists() else None  # None: wandb draws one
    # resume="allow": the same id continues the run; steps at or below the last row wandb has
    # (written after the checkpoint a restart resumes from) are dropped by wandb with a warning.
    self.run = wandb.init(project=project, entity=entity or None, name=name or None, mode=mode,
                          tags=wandb_tags(tags), config=dict(config or {}), id=run_id,
                          resume="allow")
    if run_id is None:
      id_file.parent.mkdir(parents=True, exist_ok=True)
      id_file.write_text(self.run.id)
    _log.info("wandb run %s (%s mode).", self.run.id, mode)

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    """Several calls for one step make one row (wandb commits it when a later step arrives)."""
    if self.run is None:
      return
    self.run.log({k: float(v) for k, v in scalars.items()}, step=int(step), commit=False)

  def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
    if self.run is None or not texts or int(step) % self.texts_every:
      return
    table = self._table(columns=["tag", "text"], data=[[k, str(v)] for k, v in texts.items()])
    self.run.log({"samples": table}, step=int(step), commit=False)

  def flush(self) -> None:
    """Nothing to do: wandb's service sends rows in the background."""

  def close(self) -> None:
    """Finishes the run and returns once its ``.wandb`` file is complete on disk.

    ``run.finish()`` returns when wandb's service has the exit record, but the service keeps the
    run's records (run, history, ...) in a buffer that it writes when it closes the run's stream,
    and it closes it after ``finish()`` has returned (wandb 0.31: ``inform_finish`` is sent
    without waiting). Read right away (``wandb sync`` of an offline run, a test), the file may
    hold only its header. ``wandb.teardown()`` waits for the service process to exit, hence for
    every stream to be written; it is skipped while another run of this process is active (it
    would end that run too), and that run's own finish or exit then completes the file.
    """
    if self.run is not None:
      import wandb  # pylint: disable=g-import-not-at-top
      self.run.finish()
      if wandb.setup().most_recent_active_run is None:
        wandb.teardown()
    self.run = None


class MultiWriter:
  """Sends every call to each sink; `close` closes them all even if one fails."""

  def __init__(self, writers: Iterable[Any]):
    self.writers = list(writers)

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    for w in self.writers:
      w.write_scalars(step, scalars)

  def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
    for w in self.writers:
      w.write_texts(step, texts)

  def flush(self) -> None:
    for w in self.writers:
      w.flush()

  def close(self) -> None:
    errors = []
    for w in self.writers:
      try:
        w.close()
      except Exception as err:  # pylint: disable=broad-except
        errors.append(err)
    if errors:
      raise errors[0]

  def __enter__(self) -> MultiWriter:
    return self

  def __exit__(self, exc_type, *exc) -> None:
    run_files.close_on_exit(self.close, raising=exc_type is not None)


def open_writers(spec: RunSpec, workdir: str | os.PathLike, *,
                 resume_step: int | None = None, active: bool | None = None) -> MultiWriter:
  """TensorBoard + JSONL, and wandb when ``spec.logging.wandb.enable``."""
  writers: list[Any] = [MetricsWriter(workdir, resume_step=resume_step, active=active)]
  wb = spec.logging.wandb
  if wb.enable:
    try:
      writers.append(WandbWriter(workdir, project=wb.project, entity=wb.entity, name=wb.name,
                                 mode=wb.mode, tags=wb.tags, config=spec.to_dict(),
                                 texts_every=spec.logging.samples_every or 1, active=active))
    except BaseException:
      writers[0].close()
      raise
  return MultiWriter(writers)
