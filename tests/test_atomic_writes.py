"""run_files.write_bytes_atomic with several writers of one file on one disk (every process of a
run writes config.json; the 2-rank launch test's ranks share the workdir)."""

import os

from dapo_jax.infra import run_files


def test_a_second_writer_between_write_and_rename_does_not_break_the_first(tmp_path,
                                                                          monkeypatch):
  """Another process writes and renames the same file while this one is between its write and
  its rename: both writes land (the last one wins), no FileNotFoundError, no temporary left."""
  path = tmp_path / "config.json"
  real_replace, raced = os.replace, []

  def replace(src, dst):
    if not raced:
      raced.append(True)
      run_files.write_text_atomic(path, '{"rank": 1}')  # the other writer, start to end
    real_replace(src, dst)

  monkeypatch.setattr(os, "replace", replace)
  run_files.write_text_atomic(path, '{"rank": 0}')
  assert raced and path.read_text() == '{"rank": 0}'
  assert sorted(os.listdir(tmp_path)) == ["config.json"]
