"""wtype command lines whose keymap clients read as a real keyboard.

wtype gives every new keysym of a call the next keycode, from evdev code 1 up, in a keymap of
that call's keys only. Clients that look at the key's physical code then see nonsense: the
14th distinct character of a text lands on KEY_BACKSPACE, and Chromium, which derives the
key's DOM code and Windows key code from the evdev code for punctuation, deletes a character
instead of typing '>'. And GTK 3 never matches a shortcut on the keymap's highest keycode
(gdk_wayland_keymap_get_entries_for_keyval scans [min, max)), so "wtype -M ctrl -k s" saves
nothing in mousepad.

So each call starts with key releases, one per keycode from 1 up (wlroots drops a release
of a key that is not down, so nothing reaches a client), that fix which keysym gets which
code: characters get codes of ordinary character keys on a US keyboard, editing and
navigation keys their own code, the rest private-use placeholders, and one placeholder more
sits above the highest code.
"""

from __future__ import annotations

from collections.abc import Iterable

from ._common import TemplateError

# evdev codes (linux/input-event-codes.h) of the US layout's character keys: digits, letters
# and punctuation rows, where a client's physical-key logic has nothing special to do.
CHARACTER_CODES = (*range(2, 14), *range(16, 28), *range(30, 42), *range(43, 54))
# Keys whose physical code clients act on: their own evdev code.
NAMED_CODES = {
    "escape": 1, "backspace": 14, "tab": 15, "return": 28, "kp_enter": 96, "home": 102, "up": 103,
    "prior": 104, "page_up": 104, "left": 105, "right": 106, "end": 107, "down": 108, "next": 109,
    "page_down": 109, "insert": 110, "delete": 111, "menu": 127,
    **{f"f{n}": 58 + n for n in range(1, 11)}, "f11": 87, "f12": 88,
}
# xdotool's names for modifier keys pressed on their own.
MODIFIER_KEYS = {"ctrl": "Control_L", "control": "Control_L", "shift": "Shift_L", "alt": "Alt_L",
                 "super": "Super_L", "meta": "Meta_L"}
# wtype's -M/-m names, from xdotool's.
MODIFIERS = {"ctrl": "ctrl", "control": "ctrl", "shift": "shift", "alt": "alt", "super": "logo",
             "logo": "logo", "win": "logo", "meta": "logo", "altgr": "altgr"}
TEXT_KEYS = {"\n": "Return", "\t": "Tab"}


def _placeholder(i: int) -> str:
    return f"U{0xE000 + i:04X}"  # a private-use character: no client acts on it


def char_keysym(ch: str) -> str:
    """The keysym name wtype's -k takes for one character ("U0041" for "A")."""
    if ch in TEXT_KEYS:
        return TEXT_KEYS[ch]
    cp = ord(ch)
    if cp < 0x20 or 0x7F <= cp < 0xA0:
        raise TemplateError(f"cannot type the control character {ch!r}")
    return f"U{cp:04X}"


def combo_steps(combo: str) -> list[tuple[str, str]]:
    """xdotool-style chords ("ctrl+s", "Return", "ctrl+a BackSpace") as wtype steps."""
    steps: list[tuple[str, str]] = []
    for chord in combo.split():
        *mods, name = chord.split("+")
        try:
            flags = [MODIFIERS[m.lower()] for m in mods]
        except KeyError as e:
            raise TemplateError(f"unknown modifier {e.args[0]!r} in {combo!r}; use one of "
                                f"{', '.join(sorted(MODIFIERS))}") from None
        if len(name) == 1:
            name = char_keysym(name)  # the keysym type() gives the same character
        elif not mods:
            name = MODIFIER_KEYS.get(name.lower(), name)
        steps += [("-M", m) for m in flags] + [("-k", name)] + [("-m", m) for m in reversed(flags)]
    return steps


def text_steps(text: str) -> list[tuple[str, str]]:
    return [("-k", char_keysym(ch)) for ch in text]


def argv(steps: Iterable[tuple[str, str]], delay_ms: int = 0) -> list[list[str]]:
    """wtype command lines for the steps (("-k", keysym), ("-M", mod), ...): one call, or
    more when the steps hold more distinct characters than there are character keys."""
    calls: list[list[tuple[str, str]]] = [[]]
    chars: set[str] = set()
    for step in steps:
        if step[0] == "-k" and step[1].lower() not in NAMED_CODES and step[1] not in chars:
            # a new character key
            if len(chars) == len(CHARACTER_CODES):
                calls.append([])
                chars = set()
            chars.add(step[1])
        calls[-1].append(step)
    return [_one_call(c, delay_ms) for c in calls if c]


def _one_call(steps: list[tuple[str, str]], delay_ms: int) -> list[str]:
    by_code: dict[int, str] = {}
    free = iter(CHARACTER_CODES)
    seen: set[str] = set()
    for flag, name in steps:
        # wtype gives one code to one keysym; named keys are case-insensitive names.
        key = name.lower() if name.lower() in NAMED_CODES else name
        if flag != "-k" or key in seen:
            continue
        seen.add(key)
        code = NAMED_CODES.get(key)
        by_code[code if code is not None else next(free)] = name
    top = max(by_code, default=0) + 1
    out = ["wtype"]
    for code in range(1, top + 1):
        out += ["-p", by_code.get(code, _placeholder(code))]
    if delay_ms > 0:
        out += ["-d", str(int(delay_ms))]
    for flag, name in steps:
        out += [flag, name]
    return out
