"""`prime-node verify ...` handlers. Light imports at module level: `verify checkpoint` must start fast."""
from __future__ import annotations

import argparse
import sys

from protocol.identity import public_key_arg
from verify.checkpoint import verify_checkpoint


def cmd_verify_checkpoint(args: argparse.Namespace) -> int:
    """Exit 0 when the checkpoint (directory or URL) is valid; 1 with one clear error line otherwise.

    Every failure is listed on stdout (one per line) when there is more than one; the last line on stderr
    always names the first.
    """
    key = public_key_arg("--key", args.key)
    report = verify_checkpoint(args.ckpt, {key}, parent=args.parent, base=args.base,
                               progress=sys.stderr.isatty())
    for note in report.notes:
        print(f"note: {note}", file=sys.stderr)
    if report.ok:
        print(report.summary())
        return 0
    if len(report.failures) > 1:
        for line in report.failures:
            print(line)
    more = f" (+{len(report.failures) - 1} more listed above)" if len(report.failures) > 1 else ""
    print(f"error: checkpoint {args.ckpt} is invalid: {report.failures[0]}{more}", file=sys.stderr)
    return 1
