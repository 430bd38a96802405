"""`prime-node verify rollouts FILE --checkpoint CKPT [--key HEX] [--base BASE_CKPT]`.

Verifies a JSONL file of submissions against one checkpoint, offline, with the same per-rollout checks
the coordinator runs (verify.rollouts). Exit 0 when every rollout is valid, 1 otherwise (or on bad
input, with one clear line why).

Line format (one JSON object per line; blank lines are skipped; unknown fields are refused):

    {"assignment_id": "a-17",                       optional, echoed in the output
     "prompts":  [{"prompt_id": "p0", "prompt_ids": [5, 9, 2], "seeds": [11, 12]}, ...],
     "sampling": {"temperature": 1.0, "top_p": 1.0, "max_tokens": 64},
     "eos_token_id": 2,
     "policy_step": 3,
     "rollouts": [{"prompt_id": "p0", "sample_index": 1, "completion_ids": [...], "logprobs": [...],
                   "finish_reason": "stop", "commitment": "<base64>"}, ...]}

i.e. the assignment's context (`prompts` and `sampling` exactly as in the POST /v1/work answer, plus
the run's `eos_token_id`) and the POST /v1/submit body (`policy_step`, `rollouts`; docs/PROTOCOL.md, "Work
and submissions").
A rollout is checked with `prompts[prompt_id].seeds[sample_index]`. A line whose `policy_step` is not
the checkpoint's step has every rollout reported invalid with reason "step". A multi-turn rollout (`turns`,
docs/PROTOCOL.md) has every model turn replayed (turn i with `turn_seed(seed, i)`, its prompt everything
before it); its environment tokens are not checked here (that needs the task: the coordinator does it).

The checkpoint holds weights only. The architecture comes from `config.json` (a Hugging Face model
config) found in, in order: `--model-config DIR`, CKPT/, CKPT's parent
directory. CKPT may also be a plain model directory (config.json + model.safetensors), which is then
used as it is, with a warning that no signature was checked.

Output: one line per rollout on stdout ("ok" or "INVALID <reason>: <detail>"), a summary on stderr.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Iterator

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from protocol.errors import PrimeNodeError
from protocol.identity import public_key_arg
from protocol.messages import (MAX_PROMPTS_PER_ASSIGNMENT, MAX_ROLLOUTS_PER_SUBMISSION, PromptWork,
                               RolloutSubmission, Sampling, ShortStr, Step, TokenId)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

MAX_LINE_BYTES = 256 * 1024 * 1024  # a full submission of long completions with commitments fits
VERIFY_BATCH = 64  # rollouts handed to the verifier at once (it batches prefills within)


class SubmissionLine(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    assignment_id: ShortStr | None = None
    prompts: Annotated[list[PromptWork], Field(min_length=1, max_length=MAX_PROMPTS_PER_ASSIGNMENT)]
    sampling: Sampling
    eos_token_id: TokenId
    policy_step: Step
    rollouts: Annotated[list[RolloutSubmission], Field(min_length=1, max_length=MAX_ROLLOUTS_PER_SUBMISSION)]


class RolloutFileError(PrimeNodeError):
    pass


def read_lines(path: str | Path) -> Iterator[tuple[int, SubmissionLine]]:
    """Parse the JSONL file lazily; a malformed line stops everything with its line number."""
    from protocol.signing import strict_json_loads

    try:
        f = open(path, "rb")
    except OSError as e:
        raise RolloutFileError(f"cannot read {path}: {e.strerror}") from None
    with f:
        for lineno, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), start=1):
            if len(raw) > MAX_LINE_BYTES:
                raise RolloutFileError(f"{path}:{lineno}: line longer than {MAX_LINE_BYTES} bytes")
            if not raw.strip():
                continue
            try:
                yield lineno, SubmissionLine.model_validate(strict_json_loads(raw))
            except (ValueError, UnicodeDecodeError) as e:  # ValidationError is a ValueError
                raise RolloutFileError(f"{path}:{lineno}: {_first_error(e)}") from None


def _first_error(e: Exception) -> str:
    if isinstance(e, ValidationError):
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "line"
        return f"{where}: {err['msg']}"
    return f"not valid JSON ({e})"


def _find_model_config(ckpt: Path, explicit: str | None) -> Path:
    candidates = [Path(explicit)] if explicit else [ckpt, ckpt.parent]
    for d in candidates:
        if (d / "config.json").is_file():
            return d
    where = explicit or f"{ckpt} or {ckpt.parent}"
    raise RolloutFileError(f"no config.json (model architecture) in {where}; the checkpoint holds weights only")


def load_model(ckpt: str, *, key: str | None, base: str | None, model_config: str | None, workdir: Path,
               ) -> tuple[PreTrainedModel, int | None, list[str]]:
    """Verify + unpack CKPT (or take a model dir as is) -> (fp32 eval model, step or None, notes)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from protocol.checkpoint import MANIFEST_NAME, PAYLOAD_FILE_NAME, load_payload, unpack_checkpoint

    path = Path(ckpt)
    notes: list[str] = []
    if (path / MANIFEST_NAME).is_file():
        manifest = unpack_checkpoint(path, workdir, trusted_keys={key.lower()} if key else None, base=base,
                                     progress=sys.stderr.isatty())
        if not key:
            notes.append(f"no --key given: trusted the manifest's own signer {manifest.signer[:16]}… "
                         "(proves integrity, not origin)")
        payload, step = workdir / PAYLOAD_FILE_NAME, manifest.step
    elif (path / PAYLOAD_FILE_NAME).is_file():
        notes.append(f"{path} is a model directory, not a signed checkpoint: no signature checked, "
                     "policy_step not checked")
        payload, step = path / PAYLOAD_FILE_NAME, None
    else:
        raise RolloutFileError(f"{path} is neither a checkpoint ({MANIFEST_NAME}) nor a model directory "
                               f"({PAYLOAD_FILE_NAME})")
    cfg_dir = _find_model_config(path, model_config)
    try:
        config = AutoConfig.from_pretrained(str(cfg_dir))
    except (OSError, ValueError) as e:
        raise RolloutFileError(f"cannot read the model config in {cfg_dir}: {e}") from None
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = load_payload(payload)
    own = model.state_dict()
    unknown = sorted(set(state) - set(own))
    loaded = {own[k].data_ptr() for k in state if k in own}
    missing = [k for k in own if k not in state and own[k].data_ptr() not in loaded]  # tied weights are fine
    if unknown or missing:
        raise RolloutFileError(f"checkpoint does not fit {cfg_dir / 'config.json'}: "
                               f"{len(unknown)} unknown and {len(missing)} missing tensors "
                               f"(e.g. {(unknown or missing)[0]!r})")
    try:
        model.load_state_dict(state, strict=False)
    except RuntimeError as e:
        raise RolloutFileError(f"checkpoint does not fit the model config: {str(e).splitlines()[-1].strip()}") from None
    return model.float().eval(), step, notes


def _label(lineno: int, line: SubmissionLine, r: RolloutSubmission) -> str:
    aid = f" {line.assignment_id}" if line.assignment_id else ""
    return f"line {lineno}{aid} prompt {r.prompt_id} sample {r.sample_index}"


def cmd_verify_rollouts(args: argparse.Namespace) -> int:
    from verify.rollouts import RolloutVerifier, VerifyItem, turn_items

    key = public_key_arg("--key", args.key) if args.key else None
    if not Path(args.file).is_file():
        raise RolloutFileError(f"no such file: {args.file}")
    valid = invalid = multi_turn = 0
    with tempfile.TemporaryDirectory(prefix="prime-node-verify-") as tmp:
        model, step, notes = load_model(args.checkpoint, key=key, base=getattr(args, "base", None),
                                        model_config=args.model_config, workdir=Path(tmp))
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
        verifier = RolloutVerifier(model)
        for lineno, line in read_lines(args.file):
            prompts = {p.prompt_id: p for p in line.prompts}
            pending: list[tuple[str, list[VerifyItem]]] = []  # one item per model turn
            seen: set[tuple[str, int]] = set()
            for r in line.rollouts:
                label = _label(lineno, line, r)
                p = prompts.get(r.prompt_id)
                problem = None
                if step is not None and line.policy_step != step:
                    problem = f"step: submission claims policy step {line.policy_step}, checkpoint is step {step}"
                elif p is None:
                    problem = f"shape: prompt {r.prompt_id!r} is not in this line's prompts"
                elif r.sample_index >= len(p.seeds):
                    problem = f"shape: sample_index {r.sample_index} but the prompt has {len(p.seeds)} seeds"
                elif (r.prompt_id, r.sample_index) in seen:
                    problem = "shape: duplicate (prompt_id, sample_index)"
                seen.add((r.prompt_id, r.sample_index))
                if problem:
                    print(f"INVALID {problem} [{label}]")
                    invalid += 1
                    continue
                assert p is not None  # a missing prompt is a problem above
                if r.turns:
                    multi_turn += 1
                pending.append((label, turn_items(list(p.prompt_ids), r, p.seeds[r.sample_index],
                                                  line.sampling.temperature, line.sampling.top_p,
                                                  line.sampling.max_tokens, line.eos_token_id)))
            for i in range(0, len(pending), VERIFY_BATCH):
                chunk = pending[i:i + VERIFY_BATCH]
                verdicts = iter(verifier.verify_many([it for _, items in chunk for it in items]))
                for label, items in chunk:
                    failed = [(turn, v) for turn, v in enumerate([next(verdicts) for _ in items]) if not v.ok]
                    if not failed:
                        valid += 1
                        print(f"ok [{label}]")
                    else:
                        invalid += 1
                        turn, verdict = failed[0]
                        where = f" (model turn {turn})" if len(items) > 1 else ""
                        print(f"INVALID {verdict.reason}{where}: {verdict.detail} [{label}]")
    total = valid + invalid
    if total == 0:
        raise RolloutFileError(f"{args.file} holds no rollouts")
    print(f"{total} rollouts: {valid} valid, {invalid} invalid", file=sys.stderr)
    if multi_turn:
        print(f"note: {multi_turn} multi-turn rollouts: every model turn was replayed; the environment's tokens "
              "were not checked (that needs the task, which the coordinator runs)", file=sys.stderr)
    return 0 if invalid == 0 else 1
