"""Rewards for GRPO: built-in verifiers, or a function in a Python file the user names, each call under a timeout.

    numeric   1 if the reply's last number equals the reference answer's last number (GSM8K's "#### 42" works), else 0
    format    1 if the reply ends its reasoning with "The answer is N." (the 8-shot chain-of-thought form), else 0
    FILE.py:FUNCTION   FUNCTION(reply=…, prompt=…, answer=…) → a number; answer is None where the row has none
"""

from __future__ import annotations

import importlib.util
import math
import re
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qkv.errors import QkvError

Reward = Callable[..., Any]
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
ANSWER_IS = re.compile(r"The answer is \$?(-?[\d,]*\.?\d+)")
BUILT_IN = ("numeric", "format")


def last_number(text: str) -> float | None:
    """The last number written in `text` (commas as thousands separators), or None."""
    found = NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def numeric(reply: str, prompt: str, answer: str | None) -> float:
    """1.0 if the reply's last number equals the answer's last number, else 0.0."""
    want = last_number(answer or "")
    if want is None:
        raise QkvError("the numeric reward needs each prompt's \"answer\" holding a number")
    got = last_number(reply)
    return float(got is not None and math.isclose(got, want, rel_tol=0.0, abs_tol=1e-6))


def format_reward(reply: str, prompt: str, answer: str | None) -> float:
    """1.0 if the reply states "The answer is N", else 0.0."""
    return float(ANSWER_IS.search(reply) is not None)


def load_reward(name: str) -> Reward:
    """A built-in reward by name, or FUNCTION from FILE.py in "FILE.py:FUNCTION"; a one-line error otherwise."""
    if name == "numeric":
        return numeric
    if name == "format":
        return format_reward
    path, _, function = name.rpartition(":")
    if not path.endswith(".py") or not function:
        raise QkvError(f"--reward {name!r} is neither {' nor '.join(BUILT_IN)} nor FILE.py:FUNCTION")
    if not Path(path).is_file():
        raise QkvError(f"--reward {name}: {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"qkv_reward_{Path(path).stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the user's file: whatever it raises is reported in one line
        raise QkvError(f"--reward {name}: importing {path} raised {type(e).__name__}: {e}") from None
    fn = getattr(module, function, None)
    if not callable(fn):
        raise QkvError(f"--reward {name}: {path} has no function {function}")
    return fn


class _Timeout(Exception):
    pass


def score(reward: Reward, reply: str, prompt: str, answer: str | None, timeout: float, where: str) -> float:
    """reward(reply=…, prompt=…, answer=…) as a finite float, within `timeout` seconds (on the main thread, where a
    signal can interrupt it); a one-line error naming `where` (the prompt) if it raises, hangs or returns no number."""
    alarm = timeout > 0 and hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()

    def expire(signum: int, frame: Any) -> None:
        raise _Timeout

    previous = signal.signal(signal.SIGALRM, expire) if alarm else None
    if alarm:
        signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        value = reward(reply=reply, prompt=prompt, answer=answer)
    except _Timeout:
        raise QkvError(f"the reward took over {timeout:g} s on {where}; make it faster or raise "
                       "--reward-timeout") from None
    except QkvError as e:
        raise QkvError(f"{e} ({where})") from None
    except Exception as e:  # the user's function: anything it raises is reported in one line
        raise QkvError(f"the reward raised {type(e).__name__}: {e} on {where}; fix the function") from None
    finally:
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise QkvError(f"the reward returned {value!r} on {where}; return a finite number")
    return float(value)
