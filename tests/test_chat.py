"""``kvcompress chat`` and ``generate --stream`` as a user meets them: through a pseudo-terminal, answers
as they come, Ctrl-C in an answer and at the prompt, bad commands, a saved chat continued, end of input."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time

import pytest

import kvcompress as kvc
from kvcompress.cli import main
from tests.fixtures import char_tokenizer, random_text, tiny_model

DOCUMENT = random_text(400, seed=13)
QUESTIONS = ("What is the first word?", "And the second?")
pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals are POSIX")


class Terminal:
    """A process on a pseudo-terminal (its controlling terminal: Ctrl-C there interrupts it)."""

    def __init__(self, *args: str) -> None:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, ["src", os.environ.get("PYTHONPATH")])),
            "COLUMNS": "200",
        }
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the command, on the terminal
            os.execvpe(sys.executable, [sys.executable, "-m", "kvcompress", *args], env)
        self.seen = ""

    def expect(self, text: str, timeout: float = 120) -> str:
        """Read until ``text`` has been printed; what came before it."""
        deadline = time.monotonic() + timeout
        while text not in self.seen:
            left = deadline - time.monotonic()
            assert left > 0, f"waited {timeout} s for {text!r}; the terminal shows:\n{self.seen[-2000:]}"
            if select.select([self.fd], [], [], left)[0]:
                try:
                    self.seen += os.read(self.fd, 4096).decode(errors="replace").replace("\r\n", "\n")
                except OSError:  # the process ended
                    break
        assert text in self.seen, f"the process ended without printing {text!r}:\n{self.seen[-2000:]}"
        before, _, self.seen = self.seen.partition(text)
        return before

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def paste(self, text: str, piece: int = 1024) -> None:
        """``text`` written a piece at a time, what the terminal echoes read between pieces (a long paste would
        otherwise fill the echo's buffer and stop both sides)."""
        for start in range(0, len(text), piece):
            os.write(self.fd, text[start : start + piece].encode())
            while select.select([self.fd], [], [], 0.05)[0]:
                self.seen += os.read(self.fd, 65536).decode(errors="replace").replace("\r\n", "\n")

    def wait(self) -> int:
        _, status = os.waitpid(self.pid, 0)
        return os.waitstatus_to_exitcode(status)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat")
    tiny_model().save_pretrained(folder / "model")
    char_tokenizer().save_pretrained(folder / "model")
    (folder / "doc.txt").write_text(DOCUMENT)
    return folder


def answers(turns: list[str], method: kvc.Method, max_new_tokens: int) -> list[str]:
    """The library's answers to a conversation over the document (what the chat must print)."""
    model, tok = tiny_model(), char_tokenizer()
    turn = kvc.compress(model, tok, [{"role": "user", "content": DOCUMENT}], method=kvc.FullKV())
    texts = []
    for text in turns:
        turn = kvc.generate(model, tok, text, past=turn, method=method, max_new_tokens=max_new_tokens)
        texts.append(turn.text)
    return texts


def test_a_chat_session_as_a_user_has_it(files):
    chat = Terminal(
        "chat",
        "--model",
        str(files / "model"),
        "--prompt-file",
        str(files / "doc.txt"),
        "--method",
        "snapkv",
        "--budget",
        "48",
        "--window",
        "8",
        "--max-new-tokens",
        "6",
    )
    chat.expect("> ")
    expected = answers(list(QUESTIONS), kvc.SnapKV(budget=48, window=8), 6)
    for question, answer in zip(QUESTIONS, expected):
        chat.send(question + "\n")
        shown = chat.expect("prompt tokens]")
        assert answer.strip() in shown and "TTFT" in shown and "tokens/s" in shown and "MiB | store" in shown
        chat.expect("> ")
    chat.send("/bogus\n")
    assert "unknown command /bogus; commands: /save FILE" in chat.expect("> ")
    chat.send("/reset please\n")  # forgets the conversation (whatever follows the command): a first question again
    assert "conversation reset; the document is kept" in chat.expect("> ")
    chat.send(QUESTIONS[0] + "\n")
    assert expected[0].strip() in chat.expect("prompt tokens]")
    chat.expect("> ")
    chat.send(QUESTIONS[1] + "\n")
    assert expected[1].strip() in chat.expect("prompt tokens]")
    chat.expect("> ")
    chat.send("/save\n")
    assert "usage: /save FILE" in chat.expect("> ")
    chat.send(f"/save {files / 'chat.kvc'}\n")
    assert "saved to" in chat.expect("> ")
    chat.send(f"/save {files / 'chat.kvc'}\n")
    assert "exists; /save to another name" in chat.expect("> ")
    chat.send("\x03")  # Ctrl-C at the prompt: a fresh prompt
    chat.expect("> ")
    chat.send("\x04")  # end of input ends the session
    assert chat.wait() == 0
    # the saved chat continues where it stopped, in another session
    again = Terminal(
        "chat",
        "--model",
        str(files / "model"),
        "--past",
        str(files / "chat.kvc"),
        "--method",
        "snapkv",
        "--budget",
        "48",
        "--window",
        "8",
        "--max-new-tokens",
        "6",
    )
    greeting = again.expect("> ")  # issue 81.7: a resumed conversation says so
    assert f"Resuming a saved conversation of 2 questions; its last answer: {' '.join(expected[1].split())}" in greeting
    again.send("Say it again.\n")
    third = answers([*QUESTIONS, "Say it again."], kvc.SnapKV(budget=48, window=8), 6)[-1]
    assert third.strip() in again.expect("prompt tokens]")
    again.send("/quit\n")
    assert again.wait() == 0


def test_ctrl_c_stops_the_answer_not_the_session(files):
    chat = Terminal(
        "chat",
        "--model",
        str(files / "model"),
        "--prompt-file",
        str(files / "doc.txt"),
        "--method",
        "snapkv",
        "--budget",
        "48",
        "--window",
        "8",
        "--votes",
        "sum",
        "--pooling",
        "max",
        "--max-new-tokens",
        "580",
    )
    # greedy, this model's answer runs to the limit: over a second of decoding to interrupt
    assert (
        len(answers(["Tell me everything."], kvc.SnapKV(budget=48, window=8, votes="sum", pooling="max"), 580)[0]) > 400
    )
    chat.expect("> ")
    chat.send("Tell me everything.\n")
    chat.expect("Tell me everything.\n")
    time.sleep(0.3)
    os.kill(chat.pid, signal.SIGINT)  # what Ctrl-C sends the terminal's process
    assert "answer stopped; the conversation goes on" in chat.expect("> ")
    # the stopped turn is not part of the conversation: the next one is the first
    chat.send("/bogus\n")
    chat.expect("> ")
    chat.send("x" * 700 + "\n")  # past the model's context: one line, and the session goes on
    assert "kvcompress: error: prompt 0 has" in chat.expect("> ")
    chat.send("/quit\n")
    assert chat.wait() == 0


def test_generate_streams_and_samples_on_the_command_line(files, capsys):
    def run(*args: str) -> tuple[int, str, str]:
        code = main(["generate", "--model", str(files / "model"), "--prompt", DOCUMENT, *args])
        shown = capsys.readouterr()
        return code, shown.out, shown.err

    sampled = [
        json.loads(run("--max-new-tokens", "8", "--temperature", "1.2", "--seed", str(seed), "--json")[1])
        for seed in (5, 5, 6)
    ]
    assert sampled[0]["text"] == sampled[1]["text"] != sampled[2]["text"]
    greedy = json.loads(run("--max-new-tokens", "8", "--json")[1])["text"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, ["src", os.environ.get("PYTHONPATH")]))}
    streamed = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvcompress",
            "generate",
            "--model",
            str(files / "model"),
            "--prompt",
            DOCUMENT,
            "--max-new-tokens",
            "8",
            "--stream",
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert streamed.returncode == 0 and streamed.stdout.startswith(greedy)
    code, _, err = run("--stream", "--json")
    assert code == 2 and err.count("\n") == 1 and "--stream prints the answer as it comes" in err
    code, _, err = run("--top-p", "1.5")
    assert code == 2 and "--top-p 1.5 is outside the valid range (0, 1]" in err


@pytest.fixture(scope="module")
def saved_chat(files):
    """A chat saved after one turn of SnapKV 48 (what ``/save`` writes), and the turn itself."""
    model, tok = tiny_model(), char_tokenizer()
    store = kvc.compress(model, tok, [{"role": "user", "content": DOCUMENT}], method=kvc.FullKV())
    turn = kvc.generate(model, tok, QUESTIONS[0], past=store, method=kvc.SnapKV(budget=48, window=8), max_new_tokens=6)
    turn.save(files / "saved-chat.kvc")
    return files / "saved-chat.kvc", turn, model, tok


@pytest.mark.parametrize(
    "method", [kvc.SnapKV(budget=48, window=8), kvc.StreamingLLM(budget=48)], ids=lambda method: method.name
)
def test_a_saved_chat_asked_with_a_method_is_compressed_over_its_document(files, saved_chat, capsys, method):
    """Issue 68.1: a stored conversation asked with a method (its own or another) compresses the new question
    over the stored document and the conversation, on every way in; never decodes over the last turn's selection."""
    path, turn, model, tok = saved_chat
    expected = kvc.generate(model, tok, QUESTIONS[1], past=turn, method=method, max_new_tokens=6)
    assert expected.stats["prompt_tokens"] > int(turn.store.attention_mask.sum())  # the document, prefilled over
    flags = [
        f"--{key.replace('_', '-')}={value}"
        for key, value in method.settings().items()
        if value is not None and value != type(method)().settings()[key]
    ]
    assert (
        main(
            [
                "generate",
                "--model",
                str(files / "model"),
                "--past",
                str(path),
                "--method",
                method.name,
                *flags,
                "--prompt",
                QUESTIONS[1],
                "--max-new-tokens",
                "6",
                "--json",
            ]
        )
        == 0
    )
    asked = json.loads(capsys.readouterr().out)
    assert asked["text"] == expected.text and asked["prompt_tokens"] == expected.stats["prompt_tokens"]
    loaded = kvc.load(path, model, tok)
    assert kvc.generate(model, tok, QUESTIONS[1], past=loaded, method=method, max_new_tokens=6).text == expected.text
    if method.name == "snapkv":  # without --method: the chat's own method, as chat goes on with it
        assert (
            main(
                [
                    "generate",
                    "--model",
                    str(files / "model"),
                    "--past",
                    str(path),
                    "--prompt",
                    QUESTIONS[1],
                    "--max-new-tokens",
                    "6",
                    "--json",
                ]
            )
            == 0
        )
        assert json.loads(capsys.readouterr().out)["text"] == expected.text
        again = Terminal("chat", "--model", str(files / "model"), "--past", str(path), "--max-new-tokens", "6")
        assert "Asking snapkv(budget=48" in again.expect("> ")  # issue 68.8: the saved method kept
        again.send(QUESTIONS[1] + "\n")
        assert expected.text.strip() in again.expect("prompt tokens]")
        again.send("/quit\n")
        assert again.wait() == 0


def test_raw_over_a_chat_format_file_and_chats_that_cannot_start_are_refused_at_once(files, saved_chat, capsys):
    """Issues 68.2 and 68.8: --raw over a file in the chat template, a method that cannot be asked per question,
    a file that keeps only its method's selection: each one line, before any question."""
    path = saved_chat[0]
    model = ["--model", str(files / "model")]
    for command in (["generate", "--prompt", "q?"], ["chat"]):
        assert main([*command, *model, "--past", str(path), "--raw"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--raw asks in raw text, and" in err and "leave --raw out" in err
    assert main(["chat", *model, "--prompt-file", str(files / "doc.txt"), "--method", "kvzip"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "kvzip(" in err and "observation pass before its question" in err
    assert (
        main(
            [
                "compress",
                *model,
                "--prompt-file",
                str(files / "doc.txt"),
                "--budget",
                "48",
                "--out",
                str(files / "kvzip.kvc"),
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert main(["chat", *model, "--past", str(files / "kvzip.kvc")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "compressed with kvzip(budget=48" in err and "compress --method full" in err


def test_the_chat_reads_its_input_as_a_repl_does(files):
    """Issue 68.3, through a pseudo-terminal: arrow keys edit the line (no escape codes in it), the up arrow recalls
    the last one, a 46,000-character paste arrives whole (the terminal's line buffer holds 4,095 bytes), and a
    message between lines of \"\"\" keeps its line breaks."""
    chat = Terminal(
        "chat",
        "--model",
        str(files / "model"),
        "--prompt-file",
        str(files / "doc.txt"),
        "--method",
        "snapkv",
        "--budget",
        "48",
        "--window",
        "8",
        "--max-new-tokens",
        "2",
    )
    chat.expect("> ")
    chat.send(f"/save {files / 'edted.kvc'}" + "\x1b[D" * len("ted.kvc") + "i\n")  # typed, then mended with arrows
    assert f"saved to {files / 'edited.kvc'}" in chat.expect("> ") and (files / "edited.kvc").exists()
    chat.send("\x1b[A\n")  # the last line again, from the history
    assert f"{files / 'edited.kvc'} exists" in chat.expect("> ")
    chat.paste("x" * 46_000 + "\n")
    refused = chat.expect("> ")
    told = int(refused.split("kvcompress: error: prompt 0 has ")[1].split()[0])
    assert 46_000 < told < 46_000 + 600  # the whole paste, the document and the template's tokens
    chat.send('"""\nline one\nline two\n"""\n')
    shown = chat.expect("prompt tokens]")
    model, tok = tiny_model(), char_tokenizer()
    store = kvc.compress(model, tok, [{"role": "user", "content": DOCUMENT}], method=kvc.FullKV())
    expected = kvc.generate(
        model, tok, "line one\nline two", past=store, method=kvc.SnapKV(budget=48, window=8), max_new_tokens=2
    )
    assert f"{expected.stats['prompt_tokens']} prompt tokens]" in shown + "prompt tokens]"
    chat.expect("> ")
    chat.send("/quit\n")
    assert chat.wait() == 0
