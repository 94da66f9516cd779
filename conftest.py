"""One guard over every test (pytest loads this file before the tests): a test leaves the repository's run folders
(out*/) as it found them. A user runs the README's command (1), which trains into out-shakespeare-char/, and then the
tests (command 2); a test that ran train.py with a config's own out_dir would find that run's checkpoints and fail
("a checkpoint of an earlier run"), or, had it trained, would have saved into the user's run and deleted its older
checkpoints (keep_last). So each test that runs train.py names an out_dir under its tmp_path, and this fixture fails
the test that did not, naming what it changed. test_gpu.py's own folder, out-test-gpu/, is that file's to empty."""
import os

import pytest

ROOT = os.path.dirname(os.path.abspath(__file__))
OWN = {'out-test-gpu'}  # test_gpu.py writes its runs there, and empties it when imported


def run_folders():
    """Every file and folder under the repository's out*/ (but OWN), with its size and time of change."""
    seen = {}
    for top in sorted(os.listdir(ROOT)):
        if not top.startswith('out') or top in OWN or not os.path.isdir(os.path.join(ROOT, top)):
            continue
        for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
            for name in [''] + files:
                path = os.path.join(folder, name)
                st = os.stat(path)
                seen[os.path.relpath(path, ROOT)] = (st.st_size, st.st_mtime_ns)
    return seen


@pytest.fixture(autouse=True)
def run_folders_untouched():
    before = run_folders()
    yield
    after = run_folders()
    changed = sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
    if changed:
        pytest.fail(f"this test changed the repository's run folders: {', '.join(changed[:5])}"
                    f"{' ...' if len(changed) > 5 else ''}: give the train.py it runs --out_dir= under its tmp_path",
                    pytrace=False)
