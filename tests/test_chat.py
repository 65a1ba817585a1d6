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
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, ["src", os.environ.get("PYTHONPATH")])),
               "COLUMNS": "200"}
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
    chat = Terminal("chat", "--model", str(files / "model"), "--prompt-file", str(files / "doc.txt"), "--method",
                    "snapkv", "--budget", "48", "--window", "8", "--max-new-tokens", "6")
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
    again = Terminal("chat", "--model", str(files / "model"), "--past", str(files / "chat.kvc"), "--method", "snapkv",
                     "--budget", "48", "--window", "8", "--max-new-tokens", "6")
    again.expect("> ")
    again.send("Say it again.\n")
    third = answers([*QUESTIONS, "Say it again."], kvc.SnapKV(budget=48, window=8), 6)[-1]
    assert third.strip() in again.expect("prompt tokens]")
    again.send("/quit\n")
    assert again.wait() == 0


def test_ctrl_c_stops_the_answer_not_the_session(files):
    chat = Terminal("chat", "--model", str(files / "model"), "--prompt-file", str(files / "doc.txt"), "--method",
                    "snapkv", "--budget", "48", "--window", "8", "--max-new-tokens", "580")
    # greedy, this model's answer runs to the limit: over a second of decoding to interrupt
    assert len(answers(["Tell me everything."], kvc.SnapKV(budget=48, window=8), 580)[0]) > 400
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

    sampled = [json.loads(run("--max-new-tokens", "8", "--temperature", "1.2", "--seed", str(seed), "--json")[1])
               for seed in (5, 5, 6)]
    assert sampled[0]["text"] == sampled[1]["text"] != sampled[2]["text"]
    greedy = json.loads(run("--max-new-tokens", "8", "--json")[1])["text"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, ["src", os.environ.get("PYTHONPATH")]))}
    streamed = subprocess.run([sys.executable, "-m", "kvcompress", "generate", "--model", str(files / "model"),
                               "--prompt", DOCUMENT, "--max-new-tokens", "8", "--stream"], capture_output=True,
                              text=True, env=env)
    assert streamed.returncode == 0 and streamed.stdout.startswith(greedy)
    code, _, err = run("--stream", "--json")
    assert code == 2 and err.count("\n") == 1 and "--stream prints the answer as it comes" in err
    code, _, err = run("--top-p", "1.5")
    assert code == 2 and "--top-p 1.5 is invalid; give a number in (0, 1]" in err
