"""``kvcompress chat``: a conversation over a document, every turn compressed per question.

The document is stored once (its whole KV in host memory on a GPU) or read from a ``.kvc`` file;
each message is then prefilled over the store with the conversation so far and compressed by the
chosen method (``generate(past=..., method=...)``), its answer printed as it comes, then one line of
what the turn cost. Input is read as a shell reads it (``read_line``: GNU readline on a terminal; ``read_message``:
a message of several lines between lines of ``\"\"\"``). Ctrl-C stops the answer in progress (the conversation
goes on from the last whole answer); Ctrl-D (end of input) or ``/quit`` ends the session.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .generation.generate import generate
from .generation.result import Result
from .generation.stops import Stops, text_of
from .methods import Method

COMMANDS = (
    '/save FILE (write the conversation), /reset (forget it, keep the document), /quit (or Ctrl-D); """ '
    "alone on a line opens and closes a message of several lines"
)
MULTILINE = '"""'  # a line of it alone opens, and closes, a message of several lines


class Printer:
    """A streamer (transformers' ``TextStreamer`` contract) that prints an answer's text as its tokens come:
    the prompt's tokens, put first, are skipped; a token that does not end a character waits for the next, and with
    stop strings (``stops``) the text that may begin one waits until it does not (``Stops.showable``)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, out: TextIO, stops: Stops | None = None) -> None:
        self.tokenizer, self.out, self.stops = tokenizer, out, stops
        self.ids: list[int] | None = None  # None until the prompt has been put
        self.shown = ""

    def put(self, value: Any) -> None:
        if self.ids is None:
            self.ids = []
            return
        self.ids.extend(int(t) for t in value.reshape(-1).tolist())
        text = text_of(self.tokenizer, self.ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # a character cut between tokens
            self.show(text if self.stops is None else self.stops.showable(text))

    def show(self, text: str) -> None:
        """The answer's text up to here, of which the part not shown yet is written."""
        if len(text) > len(self.shown):
            self.out.write(text[len(self.shown) :])
            self.out.flush()
            self.shown = text

    def end(self) -> None:
        if self.stops is not None and self.ids:  # what waited on a stop string that never came
            self.show(self.stops.ended(text_of(self.tokenizer, self.ids, skip_special_tokens=True)))
        self.out.write("\n")
        self.out.flush()


TICK_S = 0.1  # while a line is read on a terminal: how often a pending Ctrl-C is looked at


def read_line(prompt: str) -> str:
    """One line as a REPL reads it: on a terminal through GNU readline (``input`` once the ``readline`` module is
    loaded: line editing, arrow keys, history on up and down, and a paste of any length whole, since readline reads
    the terminal a key at a time rather than through the kernel's 4,095-byte line buffer); from a pipe, a plain line.
    End of input raises ``EOFError``; Ctrl-C, ``KeyboardInterrupt``, at once: readline looks at Python's signals
    only when its wait for a key is interrupted, so a Ctrl-C that lands just before that wait, or on another thread
    (torch's workers), would wait for the next key; a timer interrupts the wait every ``TICK_S`` while it lasts."""
    if not sys.stdin.isatty() or not hasattr(signal, "setitimer"):
        return input(prompt)
    import readline  # noqa: F401, PLC0415 - loading it gives input() its line editing and history

    previous = signal.signal(signal.SIGALRM, lambda signum, frame: None)
    signal.setitimer(signal.ITIMER_REAL, TICK_S, TICK_S)
    try:
        return input(prompt)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def read_message(read: Callable[[str], str]) -> str:
    """A message: one line, or, after a line of ``\"\"\"`` alone, every line up to the next such line (a message
    typed or pasted over several lines, its line breaks kept)."""
    line = read("> ")
    if line.strip() != MULTILINE:
        return line
    lines = []
    while (line := read("... ")).strip() != MULTILINE:
        lines.append(line)
    return "\n".join(lines)


def cost_line(stats: dict[str, Any]) -> str:
    """What a turn cost: time to its first token, decoding speed, the device's and the store's bytes."""
    decode = stats.get("decode_ms_per_token")
    speed = f"{1000 / decode:.1f} tokens/s" if decode else "- tokens/s"
    return (
        f"[TTFT {stats['prefill_s']:.2f} s | {speed} | device {stats['device_bytes'] / 2**20:.1f} MiB | "
        f"store {stats.get('context_bytes', 0) / 2**20:.1f} MiB | {stats['prompt_tokens']} prompt tokens]"
    )


def stored_document(loaded: Result) -> Result:
    """The stored context a loaded file's conversation is asked over (a stored document, or a saved chat's)."""
    store = loaded.question_store()
    if store is not None:
        return store
    if all(row.open_turn for row in loaded.rows):
        raise ValueError(
            f"this file holds a document compressed with {loaded.cache.method.describe()}, which keeps "
            "only what it selected, and chat compresses each question over the whole document: store it "
            "with `kvcompress compress --method full --prompt-file DOC --out FILE`, or ask this file "
            "with `kvcompress generate --past`"
        )
    raise ValueError(
        "this file holds a conversation without a stored document to ask per question; store one with "
        "`kvcompress compress --method full --prompt-file DOC --out FILE`, or continue this one with "
        "`kvcompress generate --past`"
    )


def chat(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    opened: Result,
    method: Method,
    max_new_tokens: int,
    sampling: dict[str, Any],
    read: Callable[[str], str] = read_line,
    out: TextIO = sys.stdout,
) -> int:
    """The session: ``opened`` is a stored document (or a conversation over one) to continue."""
    store, turn = stored_document(opened), opened
    out.write(
        f"Asking {method.describe()} per question over a stored document of "
        f"{int(store.attention_mask.sum())} tokens. Commands: {COMMANDS}\n"
    )
    if opened is not store:  # a saved conversation: said, so a user knows the next message continues it
        asked = sum(m["role"] == "user" for m in opened.rows[0].messages) if opened.rows[0].chat else None
        last = " ".join((opened.text if isinstance(opened.text, str) else opened.text[0]).split())
        out.write(
            f"Resuming a saved conversation{'' if asked is None else f' of {asked} questions'}; its last answer: "
            f"{last[:77] + '...' if len(last) > 80 else last}\n"
        )
    while True:
        try:
            line = read_message(read).strip()
        except EOFError:
            out.write("\n")
            return 0
        except KeyboardInterrupt:  # at the prompt: a fresh prompt, the session goes on
            out.write("\n")
            continue
        if not line:
            continue
        if line.startswith("/"):
            done = _command(line, turn, out)
            if done == "quit":
                return 0
            turn = store if done == "reset" else turn
            continue
        try:
            turn = generate(
                model,
                tokenizer,
                line,
                past=turn,
                method=method,
                max_new_tokens=max_new_tokens,
                streamer=Printer(tokenizer, out, Stops.of(sampling.get("stop"), tokenizer)),
                **sampling,
            )
        except KeyboardInterrupt:
            out.write("\n(answer stopped; the conversation goes on from the last whole answer)\n")
            continue
        except ValueError as error:  # what the message or the settings cannot do: said, and the session goes on
            out.write(f"kvcompress: error: {error}\n")
            continue
        out.write(cost_line(turn.stats) + "\n")


def _command(line: str, turn: Result, out: TextIO) -> str | None:
    """A ``/`` command: ``quit`` or ``reset`` for the session to act on, or None once it is done here (or
    refused in one line)."""
    name, _, rest = line.partition(" ")
    if name in ("/quit", "/exit"):
        return "quit"
    target = rest.strip()
    if name == "/reset":
        out.write("(conversation reset; the document is kept)\n")
        return "reset"
    if name == "/save" and not target:
        out.write("usage: /save FILE\n")
    elif name == "/save" and Path(target).exists():
        out.write(f"{target} exists; /save to another name (the chat never replaces a file)\n")
    elif name == "/save":
        try:
            turn.save(target)
            out.write(f"(saved to {target}: kvcompress chat --past {target} continues it)\n")
        except OSError as error:  # (the library's own refusal names the file already)
            out.write(f"cannot save to {target}: {error.strerror}\n" if error.strerror else f"{error}\n")
    else:
        out.write(f"unknown command {name}; commands: {COMMANDS}\n")
    return None
