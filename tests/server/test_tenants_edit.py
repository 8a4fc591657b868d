"""What a change through the tenants API (server/tenants/edit.py) writes to the tenants file: in
process, on real files, no server (the API itself: tests/server/test_tenants_api.py). The file's
comments, order, styles and quotes stay; block lists are indented under their key; a symlinked
file (a mounted ConfigMap's layout) has its target replaced, the link kept; its mode is kept."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from server.tenants import Tenants, key_hash
from server.tenants.edit import TenantConflict, add_key, add_tenant, change_tenant, revoke_key

A, B = key_hash("key-a-0123456789"), key_hash("key-b-0123456789")
FILE = f"""\
# the tenants of this server
tenants:
  # the search team, since March
  search:
    keys:
      - sha256:{A}      # the old key
    weight: 3           # three shares
    quota: {{requests_per_second: 50, burst: 100}}
  "batch":
    keys: ['{B}']
"""


def tenants_at(path: Path) -> Tenants:
    return Tenants(path, lambda: ["bert"])


def test_a_change_keeps_the_files_comments_order_and_styles(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(FILE)
    path.chmod(0o640)
    current = tenants_at(path)
    made = add_key(current, "search")
    change_tenant(current, "batch", {"weight": 2, "models": {"bert": {"in_flight": 4}}})
    added = add_tenant(current, {"name": "reports"})
    assert path.read_text() == FILE.replace(
        "    weight: 3           # three shares\n",
        f"      - sha256:{key_hash(made['key'])}\n    weight: 3           # three shares\n",
    ) + (
        "    weight: 2\n"
        "    models:\n"
        "      bert: {in_flight: 4}\n"
        "  reports:\n"
        "    keys:\n"
        f"      - sha256:{key_hash(added['key'])}\n"
    )
    assert os.stat(path).st_mode & 0o777 == 0o640
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left
    # applied: the new keys are the tenants' at once
    assert current.of_key(made["key"]).name == "search"
    assert current.by_name["batch"].weight == 2


def test_a_symlinked_file_has_its_target_replaced(tmp_path: Path) -> None:
    data = tmp_path / "..data"
    data.mkdir()
    (data / "tenants.yaml").write_text(FILE)
    link = tmp_path / "tenants.yaml"
    link.symlink_to(data / "tenants.yaml")
    current = tenants_at(link)
    revoke_key(current, "batch", f"sha256:{B[:12]}")
    assert link.is_symlink()
    assert "keys: []" in (data / "tenants.yaml").read_text()
    assert current.of_key("key-b-0123456789") is None


def test_a_file_that_is_gone_is_not_made_again(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(FILE)
    current = tenants_at(path)
    path.unlink()
    with pytest.raises(TenantConflict) as err:
        change_tenant(current, "search", {"weight": 1})
    assert err.value.message == f"cannot read tenants_file {path}: No such file or directory"
    assert not path.exists()
