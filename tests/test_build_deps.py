"""scripts/install-build-deps.sh --deb (``make deb``'s first step), run as a real process with
apt-get, dpkg-query, dpkg-checkbuilddeps and id replaced by recording stand-ins on PATH: as root it
installs debian/control's Build-Depends with ``apt-get build-dep ./``; as another user it names
them and the command, and stops. (A fresh Debian 12 container is the e2e's; this machine has them.)"""

from __future__ import annotations

import os
import stat
import subprocess

from conftest import REPO

SCRIPT = REPO / "scripts" / "install-build-deps.sh"


def fake_bin(tmp_path, uid: int, unmet_once: bool):
    """Stand-ins: every package installed per dpkg-query; dpkg-checkbuilddeps reports debhelper-compat
    unmet (until apt-get build-dep ran, with unmet_once); apt-get and id record/answer."""
    b = tmp_path / "bin"
    b.mkdir()
    log = tmp_path / "apt.log"
    scripts = {
        "dpkg-query": "printf 'install ok installed'",
        "id": f"echo {uid}",
        "apt-get": f'echo "$*" >> {log}; case "$*" in *build-dep*) touch {tmp_path}/met;; esac',
        "dpkg-checkbuilddeps": (f'[ -e {tmp_path}/met ] && exit 0\n' if unmet_once else "")
        + "echo 'dpkg-checkbuilddeps: error: Unmet build dependencies: debhelper-compat (= 13)' >&2; exit 1",
    }
    for name, body in scripts.items():
        p = b / name
        p.write_text("#!/bin/sh\n" + body + "\n")
        p.chmod(p.stat().st_mode | stat.S_IXUSR)
    env = dict(os.environ, PATH=f"{b}:{os.environ['PATH']}")
    return env, log


def test_as_root_make_deb_installs_the_build_dependencies_of_debian_control(tmp_path):
    env, log = fake_bin(tmp_path, 0, unmet_once=True)
    r = subprocess.run(["sh", str(SCRIPT), "--deb"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert log.read_text().splitlines() == ["update -q", "build-dep -y -q --no-install-recommends ./"]


def test_as_another_user_it_names_what_is_missing_and_the_command(tmp_path):
    env, log = fake_bin(tmp_path, 1000, unmet_once=False)
    r = subprocess.run(["sh", str(SCRIPT), "--deb"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert r.stderr.splitlines() == ["missing build dependencies of debian/control: debhelper-compat (= 13)",
                                     f"run: sudo apt-get build-dep ./   (in {REPO})"]
    assert not log.exists()


def test_make_deb_runs_the_build_dependency_step_before_its_recipe():
    # --no-print-directory: under `make test` this make is a sub-make, which would print "Entering directory"
    r = subprocess.run(["make", "--no-print-directory", "-n", "deb"], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    lines = r.stdout.splitlines()
    assert lines[0] == "scripts/install-build-deps.sh --deb", r.stdout
    assert any("dpkg-buildpackage" in line for line in lines[1:])
