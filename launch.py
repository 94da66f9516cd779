"""
launch: a run's ranks, from their start to their end. Under torchrun each machine's torchrun starts one process a
rank; without it a run is alone (world size 1, a process group of one, so every stage runs the same code).

start_process_group starts a rank's process group: its device (under torchrun, the GPU of its LOCAL_RANK), its
backend (nccl on GPUs, gloo on CPUs), a rendezvous of its own after each torchrun restart (restart_store). train.py's
start-up checks compare what every rank has before a step (gather_objects, ranks_where, MachineError for what one
machine lacks). Beside each rank, Stops watches for a rank that stops on its own, so that a job across machines
never waits for torch's timeout ([Note: a rank that stops on its own]), and tells when its own rank is ended by a
signal ([Note: a rank ended by a signal]). end_process_group ends a run without leaving a gloo thread to abort it at
exit ([Note: the end of a run]). And profile=True's trace: start_profiler, profiler_step.
"""
import atexit
import contextlib
import datetime
import gc
import importlib
import os
import select
import signal
import socket
import sys
import threading
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.nn.functional  # noqa: F401  before any process group: [Note: the end of a run]

# -----------------------------------------------------------------------------
# A run's process group: the start-up checks' collectives, its start (start_process_group, restart_store), its watch
# (Stops) and its end (end_process_group)


def gather_objects(obj):
    """Every rank's obj (picklable), by rank: start-up checks only (not counted; not under the fake group)."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, obj)
    return every


def ranks_where(flag, device):
    """The ranks where flag is true, on every rank: one all-reduce of a flag a rank (start-up checks, not counted)."""
    flags = torch.zeros(dist.get_world_size(), dtype=torch.int32, device=device)
    flags[dist.get_rank()] = bool(flag)
    dist.all_reduce(flags)
    return flags.nonzero().flatten().tolist()


def first_on_machine():
    """This rank is its machine's first (LOCAL_RANK 0), or cannot tell (RANK set by hand, no torchrun's
    LOCAL_WORLD_SIZE): a line meant once a machine, not once a GPU."""
    return os.environ.get('LOCAL_RANK', '0') == '0' or 'LOCAL_WORLD_SIZE' not in os.environ


def launched_world_size():
    """The world size start_process_group will give this process: a launcher's WORLD_SIZE if it set RANK too, else 1."""
    return int(os.environ['WORLD_SIZE']) if 'RANK' in os.environ else 1


def absent_gpu(device_name):
    """What is wrong with 'cuda' or 'cuda:N' as a run alone's device (it takes the GPU it names), or None. train.py and
    sample.py ask, before any CUDA call fails on it with "invalid device ordinal"."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if int(device_name.partition(':')[2] or 0) >= gpus:
        return f"torch sees {gpus} GPU(s) here, cuda:0 to cuda:{gpus - 1}: name one of them" if gpus else \
            "torch sees no GPU here: use cpu"


class MachineError(ValueError):
    """A mistake of one machine's (its GPUs, its data), which other machines of the job may not share: each machine's
    first rank says it (train.config_error)."""


def gpu_problems(device, gpus):
    """Under a launcher each rank takes the GPU of its LOCAL_RANK (start_process_group), so a machine needs one GPU
    a rank it runs; a run alone takes the one it names."""
    if 'RANK' in os.environ:
        local = os.environ.get('LOCAL_WORLD_SIZE')  # torchrun's, per machine; else at least LOCAL_RANK + 1
        ranks = max(int(local or 1), int(os.environ.get('LOCAL_RANK', 0)) + 1)
        visible = os.environ.get('CUDA_VISIBLE_DEVICES')
        return [f"this machine runs {'at least ' * (not local)}{ranks} ranks, one GPU each (cuda:LOCAL_RANK), and torch "
                f"sees {gpus} GPU(s) here{f' (CUDA_VISIBLE_DEVICES={visible!r})' * (visible is not None)}: start at "
                f"most {gpus} a machine (torchrun --nproc_per_node={gpus}), or use device=cpu"] * (ranks > gpus)
    absent = absent_gpu(device)
    return [f"device={device!r}: {absent}"] * bool(absent)


def start_process_group(device_name, backend='', quiet_for=30.0):
    """Under torchrun: one process per rank, its device, its backend ('' = nccl on GPUs, gloo on CPUs). Without
    torchrun: world size 1 (a 1-rank process group, so every stage runs the same code). Returns (device, rank,
    world size). Beside it, from the rendezvous to the end, Stops.watch ([Note: a rank that stops on its own])."""
    launched = 'RANK' in os.environ
    if not launched:  # a port the OS says is free: two runs alone on one machine must not meet at one
        os.environ.update(RANK='0', WORLD_SIZE='1', LOCAL_RANK='0', MASTER_ADDR='127.0.0.1', MASTER_PORT=str(free_port()))
    device = torch.device(device_name)
    if device.type == 'cuda':  # a launched rank: its LOCAL_RANK's GPU; a run alone: the one named (cuda:1 is cuda:1)
        device = torch.device('cuda', int(os.environ['LOCAL_RANK']) if launched else device.index or 0)
        torch.cuda.set_device(device)
    backend = backend or ('nccl' if device.type == 'cuda' else 'gloo')
    rank, world_size = int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])
    met, stops = threading.Event(), Stops(timeout=min(10.0, silent_for() or 60.0))
    stops.catch_signals()
    watcher = threading.Thread(target=stops.watch, args=(met, quiet_for), daemon=True)
    watcher.start()
    atexit.register(end_watch, stops, watcher)
    global WATCHED
    WATCHED = stops
    try:
        dist.init_process_group(backend=backend, device_id=device if backend == 'nccl' else None,
                                store=restart_store(), rank=rank, world_size=world_size)
    finally:
        met.set()
    return device, dist.get_rank(), dist.get_world_size()


# [Note: a rank that stops on its own] torchrun starts each machine's ranks on its own, and ends them on its own: when
# a rank stops, its machine's torchrun ends that machine's other ranks, and no other machine's. Those wait: at the
# rendezvous, for a rank that stopped before it (its machine's config mistake, a dataset it lacks), until torch's timeout
# (30 min for gloo); mid-run, under NCCL, in their next collective until its timeout (10 min), for a rank that raised
# (a CUDA out-of-memory on one GPU). gloo notices a peer gone at once, but each rank then prints a traceback of its own
# ("Connection closed by peer"), not the cause. So a rank that stops on its own says why as ever, and leaves its line
# in torchrun's store (key 'stopped': the first rank to stop keeps it). Each rank watches the store, once a second
# (twice before the ranks meet), beside its work: finding another machine's line, it marks it read ('read/<rank>')
# and stops with it; a line of its own machine's it only marks read (its torchrun ends it). A rank that raises after
# the line is there says that line, not its traceback. At its exit the rank that stopped waits (up to 2 s; 10 before
# the ranks meet, where some may be slow to arrive) until every rank has read it: node 0's torchrun holds the store,
# and ends, store and all, once node 0's ranks have. Under torchrun only, as the README launches it (--master_addr's
# static rendezvous, or --standalone): the keys of an attempt carry torchrun's restart count, which the machines count
# alike only when all of them restart together, not in an elastic job whose machines come and go. It costs a connection
# and a request a second per rank at node 0's store.
#
# [Note: a rank ended by a signal] A rank killed by a signal says nothing: the OOM killer's SIGKILL, a segfault. But
# its machine's torchrun then ends the machine's other ranks with SIGTERM, and passes a Ctrl-C typed there on to its
# ranks as SIGINT: those ranks tell, as a rank that raises does, so that the other machines' ranks stop
# with their line in a second, not after NCCL's timeout (10 min) in their next collective. A signal's Python handler
# runs in the main thread only, between two of its bytecodes, and the main thread may sit in a collective for as long
# as it lasts; so the signal's number is also written to a pipe (signal.set_wakeup_fd, by the C handler, at once), and
# the watcher, which waits on that pipe between its polls, acts on it: for SIGTERM it tells and exits (143, as a
# shell's; on node 0 once the others have read it, up to 2 s, as above); for SIGINT it only tells, and the main thread's
# KeyboardInterrupt ends the run as before (the main thread's own SIGTERM handler acts only if the watcher has not,
# 5 s on, or has ended). Only where a job spans machines: on one, its torchrun ends every rank. A
# forked child forgets both the pipe and the handler (a pool ending its workers with SIGTERM would end the rank), and
# so does the rank once its watcher has ended (end_watch): a SIGTERM then ends it at once, even inside C code.
# gloo's "peer gone" in the rank's next collective is what the killed rank leaves: a rank that raises it first waits
# up to 3 s for a line (tell_on_a_crash). A machine whose every rank dies at once tells no one: [Note: a machine gone
# silent].
#
# [Note: a machine gone silent] A machine whose every rank ends at once leaves no line: its only rank killed, all of
# them killed together, the machine down, frozen or cut off. So each rank of a job across machines beats: its watcher
# adds 1 to its machine's count in torchrun's store ('beat/<node>') every silent_for / 6 s (between its 1 s poll and
# 5 s; silent_for is NANOZERO_SILENT_FOR, 60 s by default, 2 at least), and each machine's first rank reads the next
# machine's count (node N watches node N + 1, the last node 0: one read a machine, whatever the job's size; while one
# machine lives, some machine it watches is the first silent one after it, so a silent machine is always found, or
# one of its silent neighbours). A count that has not moved for silent_for s, from a machine whose ranks have not ended
# their run ('ended/<node>', set by end_process_group once every rank is there), is a machine gone: the watching rank
# tells its line ("node M (host) went silent") and stops, and the rest follows [Note: a rank that stops on its own].
# The beats count processes alive, not progress: a rank stuck in a collective beats on. Counts are judged once the
# ranks met (machines start apart); after a run's end no rank waits in a collective, and node 0's torchrun keeps the
# store until every machine's torchrun is done. If node 0 is the one gone, its torchrun's store goes with it, and a
# store call to a machine that froze or fell off the network neither answers nor raises (its timeout bounds waits for
# keys, not for answers): the watcher would wait in it for good. So beside it a thread times the watcher's calls, and
# stops the rank once the store has answered none of them for silent_for s (a call that raises, node 0's torchrun
# gone, is unanswered too, and the watcher connects again at a third and two thirds of it: a connection reset alone
# does not stop the job), each machine's first rank saying so; a process that stood still itself (its GIL held) is
# given silent_for afresh. silent_for is what a frozen machine costs the rest instead of NCCL's 10 min; it must exceed
# the longest time every rank of a machine can hold Python's GIL at once.
class Stops:
    """This rank's side of [Note: a rank that stops on its own]: tell (it stops) and watch (for another's line)."""

    def __init__(self, timeout=5.0):
        self.rank, self.world_size, self.timeout = int(os.environ.get('RANK', 0)), launched_world_size(), timeout
        self.node, self.store, self.lost = os.environ.get('GROUP_RANK', '0'), None, False
        self.ended = threading.Event()  # set at exit: the watcher stops before Python does
        self.wakeup, self.signalled, self.told_ctrl_c = None, threading.Lock(), False  # [Note: a rank ended by a signal]
        self.watching, self.first, self.beats, self.answers, self.retry_at = False, False, None, Answers(None), None
        if os.environ.get('TORCHELASTIC_USE_AGENT_STORE') != 'True' or self.world_size == 1:
            return
        try:
            self.store = self.answers.on(agent_store(timeout=datetime.timedelta(seconds=timeout)))
        except RuntimeError:  # no answer in `timeout` s (node 0's torchrun ended): nobody to tell, nobody to hear
            self.lost = True
        if int(os.environ.get('GROUP_WORLD_SIZE', 1)) > 1:  # a job across machines: [Note: a machine gone silent]
            self.beats = Beats(self.node, int(os.environ['GROUP_WORLD_SIZE']))

    def tell(self, line, before_meeting=False):
        """Leaves this rank's line for the others (after it has said why itself); returns the line of the rank that
        stopped first if that was another (this rank's stop may follow from it), else None."""
        if self.store is None:
            return None
        mine = (f"rank {self.rank} on node {self.node} ({socket.gethostname()}) stopped"
                f"{' before the ranks met' * before_meeting}: {line}")
        try:
            first = self.store.compare_set('stopped', '', mine).decode()
            self.store.set(f'read/{self.rank}', '1')
        except RuntimeError:  # the store went with node 0's torchrun: its ranks have ended
            return None
        if first != mine:
            return first
        self.first = True  # this rank's line is the store's
        atexit.register(self.wait_until_read, 10.0 if before_meeting else 2.0)
        return None

    def wait_until_read(self, linger):
        keys, end = [f'read/{r}' for r in range(self.world_size)], time.monotonic() + linger
        try:
            while not self.store.check(keys) and time.monotonic() < end:
                time.sleep(0.05)
        except RuntimeError:
            pass

    def catch_signals(self):
        """[Note: a rank ended by a signal]: from the main thread, before the watcher starts; only with a store, and
        only where the job spans machines (on one, its torchrun ends every rank itself)."""
        one_machine = int(os.environ.get('LOCAL_WORLD_SIZE', 0)) == self.world_size
        if self.store is None or one_machine or threading.current_thread() is not threading.main_thread():
            return
        self.wakeup = os.pipe()
        os.set_blocking(self.wakeup[1], False)
        signal.set_wakeup_fd(self.wakeup[1], warn_on_full_buffer=False)
        signal.signal(signal.SIGTERM, self.on_sigterm_in_main_thread)
        os.register_at_fork(after_in_child=self.forget_signals)  # a forked worker's signals are not this rank's

    def on_sigterm_in_main_thread(self, signum, frame):
        """The watcher acts on the pipe's numbers in their order (a Ctrl-C's SIGINT, then torchrun's SIGTERM); this
        handler acts itself once the watcher has ended, and else 5 s later if the rank still runs (the watcher never
        saw it: something, asyncio's loop say, took the wakeup fd over): a SIGTERM is never swallowed."""
        if self.watching:
            threading.Timer(5.0, self.on_signal, (signum,)).start()
        else:
            self.on_signal(signum)

    @staticmethod
    def forget_signals():
        signal.set_wakeup_fd(-1)  # (a pool that ends its forked workers with SIGTERM would end the rank: the same pipe)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def on_signal(self, signum):
        """SIGINT: told once (the main thread's KeyboardInterrupt ends the run); SIGTERM: told, read, exit."""
        if signum == signal.SIGINT and not self.told_ctrl_c:
            self.told_ctrl_c = True
            self.tell("Ctrl-C (SIGINT) on its machine")
        elif signum == signal.SIGTERM and self.signalled.acquire(blocking=False):
            try:  # exits whatever fails on the way (a log whose reader is gone): a SIGTERM is never swallowed
                self.tell("SIGTERM (from its machine's torchrun: one of its ranks failed, one killed by a signal saying "
                          "nothing, or torchrun itself was ended; that torchrun's log says which)")
                told = self.first  # (set only where the store took this rank's line)
                if told and first_on_machine():
                    with contextlib.suppress(OSError):
                        print(f"rank {self.rank}: stopping: SIGTERM, told to the other machines", file=sys.__stderr__,
                              flush=True)
                if told and self.node == '0':  # node 0's torchrun holds the store, and ends with node 0's ranks
                    self.wait_until_read(2.0)
                with contextlib.suppress(OSError):
                    sys.stdout.flush()
            finally:
                os._exit(128 + signal.SIGTERM)

    def pause(self, seconds):
        """Waits up to `seconds`, acting at once on a signal's number in the wakeup pipe; True once the run ended."""
        if self.wakeup is None:
            return self.ended.wait(seconds)
        if select.select([self.wakeup[0]], [], [], seconds)[0]:
            for signum in os.read(self.wakeup[0], 64):
                self.on_signal(signum)
        return self.ended.is_set()

    def watch(self, met, quiet_for):
        """Beside a rank from its rendezvous to its end: stops it when another machine's rank stopped on its own;
        while it waits at the rendezvous (until `met` is set), says after quiet_for seconds what for (e.g. RANK and
        WORLD_SIZE set by hand, the other ranks never started), once a machine: a wait is never silent."""
        self.watching = True
        if self.beats is not None:  # [Note: a machine gone silent]: the watcher's store calls may never return
            threading.Thread(target=self.watch_answers, daemon=True).start()
            with contextlib.suppress(RuntimeError, AttributeError):  # (no store: AttributeError)
                self.store.set(f'host/{self.node}', socket.gethostname())  # its name, for a line that may say it
        try:
            self.watch_until_ended(met, quiet_for)
        finally:
            self.watching = False

    def watch_until_ended(self, met, quiet_for):
        says, since, told = first_on_machine(), time.monotonic(), False
        theirs, read_at = None, None  # the line it stops with, and when it read a line (None: not yet)
        while not (self.store is None and met.is_set() and self.wakeup is None and self.beats is None):  # (a run alone)
            if self.pause(1.0 if met.is_set() else min(0.5, quiet_for)):
                return
            if self.lost and not met.is_set() and theirs is None:  # the rendezvous cannot happen
                theirs, read_at = (f"torchrun's store at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} did not "
                                   f"answer for {self.timeout:g} s before the ranks met: node 0's torchrun ended, or its "
                                   "machine is out of reach (its log says why)"), time.monotonic()
            elif self.store is not None and read_at is None and (line := self.line()) is not None:
                read_at = self.mark_read()
                if not line.split(' (', 1)[0].endswith(f' on node {self.node}'):  # "rank R on node N (host) ..."
                    theirs = line  # (its own machine's line: its torchrun ends it)
            elif met.is_set() and self.beats is not None and theirs is None and (silent := self.heartbeat()):
                theirs, read_at = silent, time.monotonic()
            if theirs is not None and (says or time.monotonic() - read_at > 5):  # the machine's first rank says it,
                self.stop(theirs, says)  # then its torchrun ends the others (theirs alone would end it unsaid)
            if says and not told and not met.is_set() and time.monotonic() - since >= quiet_for:
                told = True
                print(f"rank {self.rank}: still waiting for the other {self.world_size - 1} rank(s) at "
                      f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} after {quiet_for:g} s: are they "
                      "started, with the same WORLD_SIZE and MASTER_ADDR:MASTER_PORT? (a rank that stopped before this "
                      "point said why in its machine's log)", file=sys.__stderr__, flush=True)

    def line_within(self, seconds):
        """The line of the rank that stopped first, once there (None after `seconds`, or without a store)."""
        end = time.monotonic() + seconds
        while self.store is not None and time.monotonic() < end:
            if (line := self.line()) is not None:
                return line
            time.sleep(0.05)
        return None

    def line(self):
        try:
            store = self.store
            return store.get('stopped').decode() if store.check(['stopped']) else None
        except RuntimeError:  # node 0's torchrun ended, or its machine does not answer
            self.store, self.lost = None, True
            return None

    def mark_read(self):
        with contextlib.suppress(RuntimeError):
            self.store.set(f'read/{self.rank}', '1')
        return time.monotonic()

    def heartbeat(self):
        """[Note: a machine gone silent], once the ranks met: beats, and returns the line to stop with (a silent
        machine's, told; torchrun's store silent, unsaid), else None."""
        if self.store is None:  # a call raised: connect again twice, at a third and two thirds of silent_for (each
            now = time.monotonic()  # try logs torch's warnings); watch_answers ends the wait once silent_for is up
            self.retry_at = self.retry_at or now + self.beats.silent_for / 3
            if now >= self.retry_at:
                self.retry_at = now + self.beats.silent_for / 3
                with contextlib.suppress(RuntimeError):
                    store = agent_store(timeout=datetime.timedelta(seconds=self.timeout))
                    self.store, self.retry_at = self.answers.on(store), None
            return None
        try:
            silent = self.beats.beat(self.store)
        except RuntimeError:
            self.store, self.lost = None, True
            return None
        if silent is None:
            return None
        first = self.tell(silent)
        if self.first and self.node == '0':  # the store ends with node 0's ranks: the others read it first (os._exit)
            self.wait_until_read(2.0)
        return first or silent

    def watch_answers(self):
        """[Note: a machine gone silent]: beside the watcher, whose store calls may never return (a frozen machine's
        socket neither answers nor closes): stops the rank once torchrun's store has answered none for silent_for s,
        each machine's first rank saying so, the others 2 s on if their torchrun has not ended them by then. A rank
        that asks nothing (a line read, its stop under way) is never judged."""
        says, woke = first_on_machine(), time.monotonic()
        while not self.ended.wait(1.0):
            if time.monotonic() - woke > 1.5 and self.answers.asked:  # this process stood still (its GIL held, its
                self.answers.asked = time.monotonic()  # machine suspended), an answer maybe waiting on it: afresh
            woke = time.monotonic()
            quiet = woke - (self.answers.asked or woke)
            if quiet >= self.beats.silent_for + 2 * (not says):
                self.stop(f"torchrun's store at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} has answered "
                          f"nothing for {quiet:.0f} s: node 0's torchrun ended (its ranks all ended at once, and it with "
                          "them; or it alone), or its machine is down, frozen or out of reach (node 0's log, if it has "
                          "one, says which)", says)

    def stop(self, line, says):
        stop_once(f"rank {self.rank}: stopping: {line}" if says else None)


WATCHED = None  # this process's Stops, from start_process_group: end_process_group marks its run ended
STOPPING = threading.Lock()  # the watcher and the crash hook may find the line at once: one of them says it


def silent_for():
    """[Note: a machine gone silent]: NANOZERO_SILENT_FOR's seconds (60 if unset), None if it is not a number >= 2 (the
    watcher polls once a second: a beat may come 1 s late without a machine being silent)."""
    text = os.environ.get('NANOZERO_SILENT_FOR', '60')
    with contextlib.suppress(ValueError):
        if 2 <= float(text) < float('inf'):
            return float(text)
    return None


def silent_for_problems():
    return [] if silent_for() else [f"NANOZERO_SILENT_FOR={os.environ['NANOZERO_SILENT_FOR']!r}: the seconds a machine "
                                    "of the job may go silent before the others stop, a number >= 2 (unset: 60)"]


class Answers:
    """torchrun's store, its calls timed ([Note: a machine gone silent]): `asked` is when the first call since its
    last answer was made (None: every call answered), a call that raised being unanswered."""

    def __init__(self, store):
        self.store, self.asked = store, None

    def on(self, store):  # (a store connected again: the same clock)
        self.store = store
        return self

    def __getattr__(self, name):
        call = getattr(self.store, name)

        def timed(*args):
            self.asked = self.asked or time.monotonic()
            answer = call(*args)
            self.asked = None
            return answer
        return timed


class Beats:
    """[Note: a machine gone silent]: a rank's beat, and on a machine's first rank the watch of the next machine's."""

    def __init__(self, node, nodes):
        self.silent_for = silent_for() or 60.0
        self.every, self.node, self.next = min(5.0, self.silent_for / 6), node, str((int(node) + 1) % nodes)
        self.due, self.count, self.moved = None, None, None  # when it beats next; the next machine's count; it moved

    def beat(self, store):
        """Beats if it is time; returns "node M (host) went silent: ..." once the count of the machine this one
        watches has stood still for silent_for s, none of its ranks having ended its run."""
        now = time.monotonic()
        if self.due is not None and now < self.due:
            return None
        self.due = now + self.every
        store.add(f'beat/{self.node}', 1)
        if not first_on_machine():
            return None
        count = store.add(f'beat/{self.next}', 0)  # (adding 0 reads it, whether or not it beat yet)
        if count != self.count:
            self.count, self.moved = count, now
        if now - self.moved < self.silent_for or store.check([f'ended/{self.next}']):
            return None
        host = store.get(f'host/{self.next}').decode() if store.check([f'host/{self.next}']) else 'its host unknown'
        return (f"node {self.next} ({host}) went silent: no rank of it has beaten in torchrun's store for "
                f"{now - self.moved:.0f} s, and none ended its run: its ranks were killed together, or its machine is "
                "down, frozen or out of reach (its torchrun's log, if it has one, says which)")


def stop_once(said):
    """Ends the rank with exit code 1, after saying `said` (None: nothing), once a rank whichever thread calls."""
    first = STOPPING.acquire(blocking=False)
    if not first:
        time.sleep(60)  # the other thread is saying it, and ends the process
    try:
        if said and first:  # (not sys.stderr: inside an excepthook torch's own, around it, holds sys.stderr in a buffer)
            with contextlib.suppress(OSError):
                print(said, file=sys.__stderr__, flush=True)
        with contextlib.suppress(OSError):
            sys.stdout.flush()  # os._exit flushes nothing: the log's last lines
    finally:
        os._exit(1)
        if first:  # (reached only where a test stands in for os._exit)
            STOPPING.release()


GLOO_PEER_GONE = ('Connection closed by peer', 'Connection reset by peer', 'Broken pipe', 'Socket closed')


def tell_on_a_crash():
    """sys.excepthook for a run's ranks: an exception nothing caught is told to the others (under torchrun, across
    ranks; else the traceback as ever), and if another rank stopped first, said as that rank's stop in one line (this
    one's most likely follows from it: gloo's peer gone), not a traceback. Install it before the process group:
    torch's own, which prefixes [rankN] to each line, then goes around it."""
    previous_hook = sys.excepthook

    def hook(kind, e, tb):
        message = str(e).strip().splitlines()[0] if str(e).strip() else ''
        stops = Stops()
        # gloo's peer gone is what a rank killed by a signal leaves: its machine's other ranks are about to tell why
        # ([Note: a rank ended by a signal]), so wait for their line a moment before telling this one
        first = stops.line_within(3.0) if any(gone in message for gone in GLOO_PEER_GONE) else None
        if first is not None:
            stops.mark_read()
        first = first or stops.tell(f"{kind.__name__}: {message}", before_meeting=not dist.is_initialized())
        if first is None:
            return previous_hook(kind, e, tb)
        stop_once(f"rank {os.environ['RANK']}: stopping: {first} (then here: {kind.__name__})")  # before its watcher
    sys.excepthook = hook


def end_watch(stops, watcher):
    """At exit: the watcher ends before Python does, not inside a store call as Python finalizes ([Note: the end of a
    run]): at once, or, from a store that stopped answering, after its calls' timeouts."""
    stops.ended.set()
    if stops.wakeup is not None:  # the watcher waits on the pipe: a byte wakes it (0, no signal)
        with contextlib.suppress(OSError):
            os.write(stops.wakeup[1], b'\0')
    watcher.join(timeout=3 * stops.timeout + 1)  # a poll's three calls
    if stops.wakeup is not None:  # [Note: a rank ended by a signal], after the watcher: SIGTERM ends the rank at once
        if stops.first and stops.node == '0':  # (a line told as it ended: atexit runs nothing registered during exit)
            stops.wait_until_read(2.0)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def free_port():
    """A TCP port nothing listens on now (the OS's pick, let go at once)."""
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def restart_store():
    """After torchrun restarts the workers (--max-restarts), they rendezvous in torchrun's own TCP store again,
    which still holds the dead attempt's keys (the ranks' addresses): gloo then connects to dead processes
    (pytorch/pytorch#135712). A key prefix per attempt keeps each attempt to itself. None: the default store."""
    if (os.environ.get('TORCHELASTIC_RESTART_COUNT', '0') == '0'
            or os.environ.get('TORCHELASTIC_USE_AGENT_STORE') != 'True'):
        return None
    return agent_store(world_size=int(os.environ['WORLD_SIZE']))


def agent_store(**options):
    """torchrun's own TCP store (its agent's, on node 0), its keys under this restart attempt's prefix: the ranks'
    rendezvous after a restart (restart_store) and their lines ([Note: a rank that stops on its own])."""
    store = dist.TCPStore(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']), is_master=False, **options)
    return dist.PrefixStore(f"nanozero/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


# [Note: the end of a run] A gloo collective runs on one of gloo's worker threads. The caller sees it complete
# and moves on; a moment later the worker lets go of the collective's tensors, and because a tensor made in
# Python has a Python object, dropping the last C++ reference besides that object's takes the GIL. If Python
# is shutting down by then, the worker cannot take it and the process aborts ("terminate called without an
# active exception") after a run that succeeded. A final dist.barrier() makes that likely, not rare: it keeps
# the collectives still on a worker when it was called, their tensors included, until the barrier itself is let
# go, on a worker, after the caller has returned. A core dump of bench.py zero, which ended so 4 times in about
# 105 runs on 2 CPU cores (torch 2.13), shows the worker in ~AsyncBarrierWork -> ~AsyncAllgatherWork ->
# TensorImpl::decref_pyobject -> take_gil -> pthread_exit, while Python collects garbage on its way out.
# So a run ends with an all-reduce of a tensor it keeps (a barrier that keeps nothing alive) and waits, the GIL
# released, until gloo holds none of that tensor nor of `held`, the tensors of the caller's last collectives:
# until each one's C++ use count is back to the 1 of its own Python object. Earlier collectives' tensors are let
# go while the rank waits in that all-reduce and sleeps (their workers get the GIL then). NCCL runs its work on
# the GPU's streams and is left to destroy_process_group.
# That wait covers the tensors it knows; destroy_process_group covers the rest, by destroying the group, whose
# destructor lets go of the GIL and joins gloo's workers while Python is whole. It can only do so if nothing else
# holds the group, and torch itself did: torch.distributed.nn.functional writes `group=group.WORLD` as a default
# argument of ten functions, evaluated when the module is first imported, and torch._dynamo imports it (meta
# init and torch.compile import torch._dynamo). Imported after init_process_group, it kept the default group in
# those defaults for good, its workers alive into the shutdown: a short train.py run aborted so at exit once in
# 177 (2 ranks on 2 CPU cores). Imported before any group exists (3 ms), the defaults hold None, and the group
# goes at destroy_process_group (or, under DDP, which holds it too, when the engine goes: still before shutdown).
# Any module that takes group.WORLD as a default must be imported before the group starts: bench.py zero does so for
# ZeroRedundancyOptimizer's. After FSDP2 (bench.py zero's fsdp2 kind, test_zero.py's oracle), DTensor's caches hold
# its DeviceMesh, hence the group: sharding propagation's (one of them in C++), redistribution's plans and transforms,
# the mesh's topology (clip_grad_norm_ and full_tensor fill the last two), and the sharded module sits in reference
# cycles. So the end empties those caches and collects the cycles (let_go_of_dtensor_caches), once the caller has let
# go of its engines: bench.py zero drops them first; train.py's are gone when main returns, before shutdown. Under
# torch 2.11 (the GPU machines' torch) a cache we cannot reach by name keeps the mesh even so, from fully_shard on;
# a mesh holds its process groups in its `_pg_registry`, so the end empties that of every mesh still alive.


# torch's caches that keep a DeviceMesh (so its process group) after the DTensors that used it are gone; private
# names (torch 2.13): where one is missing, it is skipped
DTENSOR_CACHES = (('torch.distributed.tensor.debug', '_clear_sharding_prop_cache'),  # op sharding, Python and C++
                  ('torch.distributed.tensor._redistribute', 'clear_redistribute_planner_cache'),
                  ('torch.distributed.tensor._redistribute', '_gen_transform_infos.cache_clear'),
                  ('torch.distributed.tensor._collective_utils', 'MeshTopoInfo.build_from_mesh.cache_clear'))


def let_go_of_dtensor_caches():
    """Empty DTENSOR_CACHES, collect the cycles a sharded module leaves and empty the process groups of the meshes still
    alive, if DTensor ran: [Note: the end of a run]."""
    if 'torch.distributed.tensor' not in sys.modules:
        return
    for module, path in DTENSOR_CACHES:
        try:
            clear = importlib.import_module(module)
        except ImportError:
            continue
        for name in path.split('.'):
            clear = getattr(clear, name, None)
        if clear is not None:
            clear()
    gc.collect()
    DeviceMesh = getattr(sys.modules.get('torch.distributed.device_mesh'), 'DeviceMesh', None)
    if DeviceMesh is None:
        return
    # (by the type's mro, not isinstance: DeviceMesh's metaclass asks each object for its __class__, and some of
    # torch's objects warn when asked)
    for mesh in (obj for obj in gc.get_objects() if DeviceMesh in type(obj).__mro__):
        getattr(mesh, '_pg_registry', {}).clear()  # (torch 2.11: nothing else lets go of the mesh)


def end_process_group(device, *held, timeout=10.0):
    """Every rank done, then the default process group goes, no gloo worker left holding a tensor of ours."""
    done = torch.ones(1, device=device)
    dist.all_reduce(done)
    done.item()  # every rank is here (NCCL returns once the all-reduce is queued: this waits for its end)
    if WATCHED is not None and WATCHED.beats is not None and WATCHED.store is not None:  # [Note: a machine gone
        with contextlib.suppress(RuntimeError):  # silent]: a machine whose ranks ended their run is not silent
            WATCHED.store.set(f'ended/{WATCHED.node}', '1')
    deadline = time.monotonic() + timeout
    while dist.get_backend() == 'gloo' and any(t._use_count() > 1 for t in (done, *held)):
        if time.monotonic() > deadline:  # e.g. `held` still viewed by the caller: say so, go
            warnings.warn(f"gloo still holds a tensor {timeout:g} s after the last collective; ending anyway")
            break
        time.sleep(1e-3)  # the GIL released: the worker takes it to let go
    let_go_of_dtensor_caches()  # FSDP2's mesh, and so the group, held by them
    dist.destroy_process_group()

# -----------------------------------------------------------------------------
# profile=True


def start_profiler(out_dir, rank, device):
    """train.py's profile=True: a torch.profiler trace of the run's iterations 2-4 (iteration 1 warms the profiler up),
    with the named ranges of our collectives and their waits (traced) to see the overlap."""
    os.makedirs(out_dir, exist_ok=True)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == 'cuda' else [])
    path = os.path.join(out_dir, f'trace_rank{rank}.json')
    # repeat=1: one wait/warmup/active cycle; without it the schedule cycles until the end of the run
    profiler = torch.profiler.profile(activities=activities, on_trace_ready=lambda p: p.export_chrome_trace(path),
                                      schedule=torch.profiler.schedule(wait=0, warmup=1, active=3, repeat=1))
    profiler.start()
    return profiler


def profiler_step(profiler, out_dir, log):
    """After each iteration. The trace's ProfilerStep#1-#3 are iterations 2-4; after the 4th the trace is written and
    the profiler stopped (None is returned), so nothing profiles or slows the rest of the run."""
    profiler.step()
    if profiler.step_num < 4:
        return profiler
    profiler.stop()
    log(f"profiler trace of iterations 2-4: {out_dir}/trace_rank{{r}}.json (open in https://ui.perfetto.dev)")
    return None
