"""``python tools/release_checks [CHECK ...]``: run the named checks (default: all), in order."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from release_checks import alone, api_compat, import_cycles, lowest, static

CHECKS = {
    "import_cycles": import_cycles.main,
    "static": static.main,
    "api_compat": api_compat.main,
    "lowest": lowest.main,
    "alone": alone.main,
}

if __name__ == "__main__":
    names = sys.argv[1:] or list(CHECKS)
    unknown = sorted(set(names) - set(CHECKS))
    if unknown:
        raise SystemExit(f"unknown checks {unknown}; choose from {sorted(CHECKS)}")
    failed = []
    for name in names:
        print(f"== {name}", flush=True)
        if CHECKS[name]() != 0:
            failed.append(name)
    print(f"== release checks: {len(names) - len(failed)} passed, failed: {failed or 'none'}")
    raise SystemExit(1 if failed else 0)
