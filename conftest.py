"""One guard over every test (pytest loads this file before the tests): a test leaves the repository's run folders as
it found them. A user runs the README's command (1), which trains into out-shakespeare-char/, and then the tests
(command 2); a test that ran train.py with a config's own out_dir would find that run's checkpoints and fail ("a
checkpoint of an earlier run"), or, had it trained, would have saved into the user's run and deleted its older
checkpoints (keep_last). So each test that runs train.py names an out_dir under its tmp_path, and this fixture fails
the test that did not, naming what it changed. The folders watched are those the configs and train.py's defaults train
into; other out*/ folders (test_gpu.py's out-test-gpu/, .ci/gpu's logs, written while its tests run) are not runs."""
import contextlib
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.abspath(__file__))
RUNS = sorted({found[1] for path in [os.path.join(ROOT, 'train.py'), *glob.glob(os.path.join(ROOT, 'config', '*.py'))]
               if (found := re.search(r"(?m)^out_dir = '([^']+)'", open(path).read()))})  # out, out-zero3, ...


def in_use():
    """The run folders a training run holds now (its lock on .lock, resume.claim): a run of the user's may write
    there while the tests run, and no test can (train.py refuses an out_dir in use). Read from Linux's /proc/locks,
    which takes no lock itself; elsewhere none is known, and every folder is watched."""
    try:
        with open('/proc/locks') as f:
            held = {fields[5] for line in f if len(fields := line.split()) > 5 and fields[1] == 'FLOCK'}
    except OSError:
        return set()
    found = set()
    for top in RUNS:
        with contextlib.suppress(OSError):
            st = os.stat(os.path.join(ROOT, top, '.lock'))
            if f'{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}' in held:
                found.add(top)
    return found


def run_folders(skip):
    """Every file and folder under the runs' folders but `skip`, with its size and time of change."""
    seen = {}
    for top in sorted(set(RUNS) - skip):
        for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
            for name in [''] + files:
                path = os.path.join(folder, name)
                try:
                    st = os.stat(path)
                except FileNotFoundError:  # gone since it was listed: something else writes there (it shows as changed)
                    continue
                seen[os.path.relpath(path, ROOT)] = (st.st_size, st.st_mtime_ns)
    return seen


@pytest.fixture(autouse=True)
def run_folders_untouched():
    live = in_use()
    before = run_folders(live)
    yield
    after = run_folders(live)
    changed = sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
    if changed:
        pytest.fail(f"this test changed the repository's run folders: {', '.join(changed[:5])}"
                    f"{' ...' if len(changed) > 5 else ''}: give the train.py it runs --out_dir= under its tmp_path",
                    pytrace=False)
