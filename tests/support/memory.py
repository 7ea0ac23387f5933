"""This process's resident memory, as Linux reports it (/proc/self): what the memory benchmarks measure. The
resident set counts every page the work touched, whichever allocator handed it out and gave it back."""

from __future__ import annotations


def proc_status_mib(field: str) -> float:
    """A field of /proc/self/status in MiB: VmRSS (the resident set now), VmHWM (its high-water mark)."""
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return int(fields[field].split()[0]) / 1024  # kB


def reset_peak_rss() -> float:
    """Reset this process's resident-set high-water mark; return the resident set now, MiB."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    return proc_status_mib("VmRSS")
