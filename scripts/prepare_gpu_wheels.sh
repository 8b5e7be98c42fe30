#!/usr/bin/env bash
# Fetch into .whl/ (git-ignored) the wheels the lent GPU image lacks, for its Python 3.12 on x86-64 Linux:
# hydra-core, omegaconf, antlr4-python3-runtime (what omegaconf pins; PyPI has only its sdist, so a pure-Python
# wheel is built here) and torchao (0.17+ is built for torch >= 2.11, the image's torch). Everything else the
# engine imports is already on the image (torch 2.11, transformers 5.17, safetensors, tensorboard, peft, pyarrow,
# PyYAML, packaging, numpy: /work/.library/device/KINDS.md's package list). One version of each: two would stop
# the install there. Run it here, then carry .whl with the device call (bench/README.md has the command line).
#   bash scripts/prepare_gpu_wheels.sh            # uses python3 -m pip; PIP="..." overrides
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-python3 -m pip}
# Pinned to what the project's CPU venv runs (torch 2.13), so both machines run the same Hydra and torchao code.
HYDRA=hydra-core==1.3.8
OMEGACONF=omegaconf==2.3.1
ANTLR=antlr4-python3-runtime==4.9.3  # omegaconf 2.3 and hydra-core 1.3 require ==4.9.*
TORCHAO=torchao==0.18.0              # built against torch >= 2.11 (ABI-stable since 0.17): runs on the image's 2.11
rm -rf .whl && mkdir -p .whl
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
$PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
  -d .whl "$HYDRA" "$OMEGACONF" "$TORCHAO"
# sdist only on PyPI: build the wheel here (pure Python, py3-none-any: runs on any CPython 3)
$PIP wheel -q --no-deps --no-binary=:all: -w .whl "$ANTLR"
# Check: every wheel's Requires-Dist is either one of these wheels or on the image (the list above).
${PIP%% -m pip} - <<'PY'
import pathlib, re, zipfile

try:
    from packaging.requirements import Requirement
except ImportError:  # the interpreter running pip always has pip's own copy
    from pip._vendor.packaging.requirements import Requirement
on_image = {"pyyaml", "packaging", "typing-extensions", "importlib-resources", "torch", "numpy"}
wheels = sorted(pathlib.Path(".whl").glob("*.whl"))
names = {re.split(r"-\d", w.name, 1)[0].lower().replace("_", "-") for w in wheels}
for w in wheels:
    with zipfile.ZipFile(w) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    for line in re.findall(r"^Requires-Dist: (.+)$", meta, re.M):
        req = Requirement(line)
        if req.marker and not req.marker.evaluate({"python_version": "3.12", "extra": ""}):
            continue  # an extra, or only for other Pythons
        if req.name.lower().replace("_", "-") not in names | on_image:
            raise SystemExit(f"{w.name} needs {line!r}: neither carried nor on the image")
total = sum(w.stat().st_size for w in wheels)
print("\n".join(f"{w.stat().st_size / 2**20:6.2f} MiB  {w.name}" for w in wheels))
print(f"{total / 2**20:6.2f} MiB in {len(wheels)} wheels (the device call carries at most 64 MiB)")
assert total < 32 * 2**20, "the carried wheels should stay well under the 64 MiB a device call carries"
PY
