"""Small QEMU guests (TCG, no KVM) that share memory with the host through ``ivshmem-plain``.

A guest boots the host's Debian kernel with a tiny busybox initramfs, mounts the host's root
filesystem read-only over 9p (so this machine's Python and the project's installed packages
are visible at the same paths), mounts a per-guest writable 9p share at ``/run/out``, chroots
into the host root and runs a script the host wrote there, then powers off.

Each shared-memory backing file (created by the caller, e.g. in /dev/shm; its size must be a
power of two, which ivshmem requires) becomes one ``ivshmem-plain`` PCI device whose BAR2 maps
the file. Inside the guest the script gets ``CXL_DEV0``, ``CXL_DEV1``, ... naming each device's
``/sys/bus/pci/devices/<bdf>/resource2`` in the order of ``shm_files`` (also listed one a line
in ``/run/out/ivshmem``); ``mmap`` it with the file's ``st_size``.

Needs the Debian packages ``qemu-system-x86``, ``linux-image-amd64`` and ``busybox-static``.
"""
from __future__ import annotations

import gzip
import hashlib
import lzma
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

QEMU = "qemu-system-x86_64"
BUSYBOX = Path("/bin/busybox")
#: Where the writable share is mounted inside the guest (also exported to the script as OUT).
GUEST_OUT = "/run/out"
#: Modules to load (with their dependencies from modules.dep) when they are not built in.
WANTED_MODULES = ("virtio_pci", "9pnet_virtio", "9p")
#: First PCI slot given to the ivshmem devices; device i sits at 0000:00:<FIRST_SLOT+i>.0.
FIRST_SLOT = 0x10
#: Where the guest mounts fresh tmpfs over the host's root (hiding the host's files there).
GUEST_TMPFS = (Path("/tmp"), Path("/run"), Path("/dev/shm"))
#: This project's checkout (CI may clone it under /tmp).
PROJECT = Path(__file__).resolve().parents[1]
#: The interpreter's environment (a virtualenv may live under /tmp, hidden by the guest's tmpfs).
ENVIRONMENT = Path(sys.prefix)
_9P = "trans=virtio,version=9p2000.L,msize=512000"

INIT = f"""#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in /lib/modules/*.ko; do insmod "$m" || echo "init: insmod $m failed"; done
for x in $(cat /proc/cmdline); do
    case "$x" in cxlrpc.name=*) hostname "${{x#cxlrpc.name=}}";; esac
done
R=/newroot
mkdir -p $R
mount -t 9p -o {_9P},ro,cache=loose root $R || {{ echo "init: cannot mount root share"; poweroff -f; }}
mount -t tmpfs run $R/run
mkdir $R{GUEST_OUT}
mount -t 9p -o {_9P} out $R{GUEST_OUT} || {{ echo "init: cannot mount out share"; poweroff -f; }}
mkdir /hostroot
mount -o bind $R /hostroot
mount -t proc proc $R/proc
mount -t sysfs sys $R/sys
mount -t devtmpfs dev $R/dev
mkdir -p $R/dev/shm
mount -t tmpfs shm $R/dev/shm
mount -t tmpfs tmp $R/tmp
while read -r p; do
    mkdir -p "$R$p" && mount -o bind "/hostroot$p" "$R$p" || echo "init: cannot bind $p"
done < $R{GUEST_OUT}/binds
i=0
for d in /sys/bus/pci/devices/*; do
    if [ "$(cat $d/vendor)" = 0x1af4 ] && [ "$(cat $d/device)" = 0x1110 ]; then
        echo 1 > $d/enable
        echo "$d/resource2" >> $R{GUEST_OUT}/ivshmem
        export "CXL_DEV$i=$d/resource2"
        i=$((i+1))
    fi
done
echo "init: running {GUEST_OUT}/run.sh"
cat /proc/uptime > $R{GUEST_OUT}/.started && mv $R{GUEST_OUT}/.started $R{GUEST_OUT}/started
chroot $R /bin/sh -c 'cd /; /bin/sh {GUEST_OUT}/run.sh > {GUEST_OUT}/stdout 2> {GUEST_OUT}/stderr; echo $? > {GUEST_OUT}/rc'
echo "init: script exited with $(cat $R{GUEST_OUT}/rc)"
sync
poweroff -f
"""


class GuestError(RuntimeError):
    """A guest failed to boot, run or finish in time (message ends with its console's tail)."""


@dataclass(frozen=True)
class GuestImage:
    """A bootable kernel and the initramfs built for it."""

    kver: str
    kernel: Path
    initrd: Path


def _kernel() -> tuple[str, Path]:
    """The newest installed Debian kernel that has its modules directory."""
    found = sorted(
        (p.name.removeprefix("vmlinuz-"), p)
        for p in Path("/boot").glob("vmlinuz-*")
        if (Path("/lib/modules") / p.name.removeprefix("vmlinuz-") / "modules.dep").exists()
    )
    if not found:
        raise GuestError("no /boot/vmlinuz-* with /lib/modules/<ver>: apt-get install linux-image-amd64")
    return found[-1]


def _modname(path: str) -> str:
    return Path(path).name.split(".ko")[0].replace("-", "_")


def _module_order(moddir: Path) -> list[Path]:
    """Files of WANTED_MODULES and their dependencies, each after what it depends on."""
    deps: dict[str, tuple[str, list[str]]] = {}
    for line in (moddir / "modules.dep").read_text().splitlines():
        target, _, rest = line.partition(":")
        deps[_modname(target)] = (target, [_modname(d) for d in rest.split()])
    builtin = {_modname(line) for line in (moddir / "modules.builtin").read_text().split()}
    order: list[Path] = []
    seen: set[str] = set()

    def visit(name: str) -> None:
        if name in seen or name in builtin:
            return
        seen.add(name)
        if name not in deps:
            raise GuestError(f"kernel module {name} is neither built in nor in {moddir}/modules.dep")
        target, needs = deps[name]
        for dep in needs:
            visit(dep)
        order.append(moddir / target)

    for name in WANTED_MODULES:
        visit(name)
    return order


def _module_bytes(path: Path) -> bytes:
    """A module's ELF bytes (busybox insmod cannot load compressed modules)."""
    data = path.read_bytes()
    if path.name.endswith(".ko.xz"):
        return lzma.decompress(data)
    if path.name.endswith(".ko.zst"):
        from compression import zstd  # type: ignore[import-not-found]  # Python >= 3.14

        return zstd.decompress(data)
    if path.name.endswith(".ko"):
        return data
    raise GuestError(f"unsupported module compression: {path}")


def _cpio(entries: list[tuple[str, int, bytes, int]]) -> bytes:
    """A cpio "newc" archive of (name, mode, data, rdev major<<8|minor) entries."""
    out = bytearray()

    def pad() -> None:
        out.extend(b"\0" * (-len(out) % 4))

    for ino, (name, mode, data, rdev) in enumerate([*entries, ("TRAILER!!!", 0, b"", 0)], 1):
        fields = (ino, mode, 0, 0, 1, 0, len(data), 0, 0, rdev >> 8, rdev & 0xFF, len(name) + 1, 0)
        out += b"070701" + b"".join(b"%08X" % f for f in fields) + name.encode() + b"\0"
        pad()
        out += data
        pad()
    return bytes(out)


def build_image(workdir: Path) -> GuestImage:
    """Build (once) the initramfs for the installed kernel, cached in ``workdir``.

    The cache directory is keyed by kernel version and by a hash of /init and of the paths and
    mtimes of the kernel, busybox and modules, so a second call is instant. Concurrent builders
    each build into a temporary directory and the first ``rename`` wins; the others drop theirs.
    """
    kver, kernel = _kernel()
    if not BUSYBOX.exists():
        raise GuestError(f"{BUSYBOX} missing: apt-get install busybox-static")
    modules = _module_order(Path("/lib/modules") / kver)
    stamps = [f"{p}:{p.stat().st_mtime_ns}" for p in (kernel, BUSYBOX, *modules)]
    key = hashlib.sha256("\0".join([INIT, *stamps]).encode()).hexdigest()[:12]
    final = workdir / f"cxlrpc-guest-{kver}-{key}"
    image = GuestImage(kver, kernel, final / "initrd.gz")
    if final.is_dir():
        return image
    entries: list[tuple[str, int, bytes, int]] = [
        (d, stat.S_IFDIR | 0o755, b"", 0)
        for d in ("bin", "dev", "proc", "sys", "lib", "lib/modules", "newroot")
    ]
    entries += [
        ("dev/console", stat.S_IFCHR | 0o600, b"", 5 << 8 | 1),
        ("bin/busybox", stat.S_IFREG | 0o755, BUSYBOX.read_bytes(), 0),
        ("init", stat.S_IFREG | 0o755, INIT.encode(), 0),
    ]
    entries += [
        (f"lib/modules/{i:02d}-{_modname(str(m))}.ko", stat.S_IFREG | 0o644, _module_bytes(m), 0)
        for i, m in enumerate(modules)
    ]
    workdir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=workdir, prefix=f".{final.name}."))
    try:
        tmp.chmod(0o755)
        (tmp / "initrd.gz").write_bytes(gzip.compress(_cpio(entries), compresslevel=6, mtime=0))
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return image


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class Guest:
    """One QEMU guest (a context manager); ``__exit__`` always kills qemu and removes its files.

    ``shm_files`` are the caller's backing files, one ivshmem-plain device each, in order.
    ``host_paths`` that lie under the guest's own tmpfs mounts (/tmp, /run, /dev/shm) are
    bind-mounted back, read-only, at the same paths, so a checkout or a virtualenv under /tmp
    stays usable.
    ``smp`` vCPUs are started, but ``maxcpus`` is at least 2: QEMU's TCG emits real host
    atomics for guest ``lock``-prefixed instructions only when the machine may have more than
    one vCPU, and cross-process atomics on the shared memory need them.
    """

    def __init__(
        self,
        image: GuestImage,
        name: str,
        shm_files: list[Path],
        mem_mb: int = 512,
        smp: int = 1,
        host_paths: tuple[Path, ...] = (PROJECT, ENVIRONMENT),
    ) -> None:
        for f in shm_files:
            size = f.stat().st_size
            if size <= 0 or size & (size - 1):
                raise ValueError(f"ivshmem backing file {f} has size {size}, not a power of two")
        self.image = image
        self.name = name
        self.shm_files = list(shm_files)
        self.mem_mb = mem_mb
        self.smp = smp
        self.host_paths = [p for p in host_paths if any(p.is_relative_to(t) for t in GUEST_TMPFS)]
        self.dir = Path(tempfile.mkdtemp(prefix=f"cxlrpc-guest-{name}-"))
        #: The writable share: the guest's ``/run/out``. The host may put files here too.
        self.out = self.dir / "out"
        self.out.mkdir()
        self.console = self.dir / "console.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0

    def __enter__(self) -> Guest:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def command(self) -> list[str]:
        """The qemu-system-x86_64 argv for this guest."""
        cmd = [
            QEMU, "-name", self.name, "-accel", "tcg,thread=multi", "-cpu", "max", "-machine", "pc",
            "-m", str(self.mem_mb), "-smp", f"{self.smp},maxcpus={max(self.smp, 2)}",
            "-nographic", "-nodefaults", "-no-user-config", "-no-reboot",
            "-serial", f"file:{self.console}", "-monitor", "none",
            "-kernel", str(self.image.kernel), "-initrd", str(self.image.initrd),
            "-append", f"console=ttyS0 panic=-1 loglevel=4 edd=off cxlrpc.name={self.name}",
            "-fsdev", "local,id=root,path=/,security_model=none,readonly=on,multidevs=remap",
            "-device", "virtio-9p-pci,fsdev=root,mount_tag=root",
            "-fsdev", f"local,id=out,path={self.out},security_model=none",
            "-device", "virtio-9p-pci,fsdev=out,mount_tag=out",
        ]  # fmt: skip
        for i, f in enumerate(self.shm_files):
            size = f.stat().st_size
            cmd += ["-object", f"memory-backend-file,id=m{i},share=on,mem-path={f},size={size}"]
            cmd += ["-device", f"ivshmem-plain,memdev=m{i},addr={FIRST_SLOT + i:#x}"]
        return cmd

    def start(self, script: str, env: dict[str, str] | None = None) -> None:
        """Boot the guest to run ``script`` (POSIX sh) with ``env``; returns at once.

        The script runs as root in the host's root filesystem (read-only), with a fresh tmpfs on
        /tmp, /dev/shm and /run, PATH starting with this interpreter's directory, and
        ``OUT=/run/out`` plus ``CXL_DEV<i>`` set.
        """
        if self.proc is not None:
            raise GuestError(f"guest {self.name} already started")
        base = {
            "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
            "HOME": "/root",
            "PYTHONDONTWRITEBYTECODE": "1",
            "OUT": GUEST_OUT,
        }
        exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in {**base, **(env or {})}.items())
        (self.out / "run.sh").write_text(exports + script + "\n")
        (self.out / "binds").write_text("".join(f"{p}\n" for p in self.host_paths))
        with open(self.dir / "qemu.log", "wb") as log:
            self.proc = subprocess.Popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        self.started_at = time.monotonic()

    def _error(self, what: str) -> GuestError:
        return GuestError(
            f"guest {self.name}: {what}\n--- qemu ---\n{_tail(self.dir / 'qemu.log')}"
            f"\n--- console ---\n{_tail(self.console)}\n--- stderr ---\n{_tail(self.out / 'stderr')}"
        )

    def _running(self) -> subprocess.Popen[bytes]:
        if self.proc is None:
            raise GuestError(f"guest {self.name} not started")
        return self.proc

    def wait(self, timeout: float) -> tuple[int, str, str]:
        """Wait for the guest to power off; return the script's (rc, stdout, stderr).

        On timeout the guest is killed and GuestError raised.
        """
        proc = self._running()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise self._error(f"did not finish within {timeout} s") from None
        try:
            rc = int((self.out / "rc").read_text())
        except (FileNotFoundError, ValueError):
            raise self._error(f"powered off (qemu rc {proc.returncode}) without the script's rc") from None
        return rc, (self.out / "stdout").read_text(), (self.out / "stderr").read_text()

    def wait_file(self, name: str, timeout: float) -> str:
        """Wait for the guest to create ``/run/out/<name>`` and return its text.

        The guest should write the file elsewhere and rename it into place if its content matters.
        Raises GuestError if the guest exits first or ``timeout`` passes.
        """
        proc = self._running()
        path = self.out / name
        deadline = time.monotonic() + timeout
        while not path.exists():
            if proc.poll() is not None:
                raise self._error(f"exited (qemu rc {proc.returncode}) before writing {name}")
            if time.monotonic() > deadline:
                raise self._error(f"did not write {name} within {timeout} s")
            time.sleep(0.05)
        return path.read_text()

    def kill(self) -> None:
        """Hard power-off: SIGKILL qemu (a host dying mid-traffic) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


def image_or_skip(workdir: Path) -> GuestImage:
    """The guest image for tests: skips without qemu, except under CI, where that fails."""
    import pytest

    if shutil.which(QEMU) is None:
        reason = f"{QEMU} not installed (apt-get install qemu-system-x86 linux-image-amd64 busybox-static)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return build_image(workdir)
