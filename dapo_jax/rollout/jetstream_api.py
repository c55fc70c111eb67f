"""JetStream's engine API (``jetstream.engine``) without TensorFlow.

dapo_jax uses JetStream's `Engine`/`Tokenizer` interfaces, ``token_utils.pad_tokens`` and its
orchestrator. None of them runs TensorFlow, but ``jetstream/engine/token_utils.py`` (0.2.2)
imports ``seqio.vocabularies`` at module level for its SentencePiece path, and seqio imports
TensorFlow and tensorflow-text (~2.1 GB, most of the install). So dapo_jax installs
google-jetstream with ``--no-deps`` (launch/setup_env.sh, launch/worker_env.sh, README) and, when
seqio is absent, imports JetStream with a stand-in for the two seqio names it binds. The stand-in
is removed from ``sys.modules`` right after, so ``import seqio`` still fails as it should.

Import JetStream's engine modules from here, before anything else imports ``jetstream.engine``:

    from dapo_jax.rollout.jetstream_api import engine_api, token_utils, tokenizer_api
"""

from __future__ import annotations

import importlib.util
import sys
import types

JETSTREAM_REQUIREMENT = "google-jetstream==0.2.2"
INSTALL_HINT = (f"dapo_jax's JetStream engine needs {JETSTREAM_REQUIREMENT}, installed without "
                f"its TensorFlow dependencies: pip install --no-deps {JETSTREAM_REQUIREMENT} "
                "(launch/setup_env.sh does this).")
_SEQIO = "seqio.vocabularies"


class _NoSeqioVocabulary:
  """Stands for seqio's vocabularies: JetStream's SentencePiece/seqio path, which dapo_jax never
  takes (its tokenizer is `jetstream_engine.JetStreamTokenizer`)."""

  def __init__(self, *args, **kwargs):
    del args, kwargs
    raise ImportError("JetStream's seqio vocabularies need seqio (and TensorFlow), which "
                      "dapo_jax does not install; use dapo_jax's JetStreamTokenizer.")


def _import_engine() -> None:
  stub = None
  if _SEQIO not in sys.modules and importlib.util.find_spec("seqio") is None:
    stub = types.ModuleType(_SEQIO, "dapo_jax stand-in: seqio is not installed.")
    stub.Vocabulary = stub.SentencePieceVocabulary = _NoSeqioVocabulary
    sys.modules[_SEQIO] = stub  # found before its parent package is looked for
  try:
    from jetstream.engine import token_utils  # noqa: F401  pylint: disable=g-import-not-at-top
  except ModuleNotFoundError as err:
    if err.name and err.name.split(".")[0] == "jetstream":
      raise ImportError(INSTALL_HINT) from err
    raise
  finally:
    if stub is not None and sys.modules.get(_SEQIO) is stub:
      del sys.modules[_SEQIO]


_import_engine()
# pylint: disable=g-import-not-at-top,wrong-import-position
from jetstream.engine import engine_api, token_utils, tokenizer_api, tokenizer_pb2  # noqa: E402

__all__ = ["engine_api", "token_utils", "tokenizer_api", "tokenizer_pb2", "INSTALL_HINT",
           "JETSTREAM_REQUIREMENT"]
