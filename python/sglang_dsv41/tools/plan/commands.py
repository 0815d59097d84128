"""What a compose service runs: its program and arguments as the process sees them.

A command may sit behind a shell (``sh -c "..."``, ``bash -lc``), ``exec``,
``env`` or variable assignments. This module reads those the way the shell
would for the simple forms (``;``/``&&`` chains, pipes, redirections,
``export``, ``$VAR``/``${VAR:-d}`` from the container's environment) and
refuses, with a reason, anything it cannot follow, so a server is never
silently skipped. No sglang import here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from sglang_dsv41.tools.plan.compose import MAX_TOTAL_CHARS

SHELLS = {"sh", "bash", "dash", "ash", "zsh", "ksh", "busybox"}
# Commands a script may run before the real program: they cannot change what
# the program resolves (arguments, environment, installed code).
HARMLESS = {"echo", "printf", "true", ":", "sleep", "mkdir", "set", "ulimit", "nvidia-smi", "wait", "ls",
            "cat", "date", "false", "hostname", "touch", "test", "[", "cd", "trap", "sync", "ibv_devinfo", "df", "free"}
_UNSUPPORTED_WORDS = {"if", "then", "else", "elif", "fi", "for", "while", "until", "do", "done", "case", "esac",
                      "function", "{", "}", "[[", "]]", "select", "coproc", "source", ".", "eval"}
_ASSIGNMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=(.*)\Z", re.S)
_VAR = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class ShellRefused(ValueError):
    """A shell script plan cannot follow to the command it runs."""


class ExpansionBudget:
    """The characters variable expansions may produce, shared by the scripts of one plan.

    ``A=$A$A`` doubles a variable in a few bytes of script; forty of them ask for
    a terabyte. A script is charged once it is read to its end, so one that runs
    past the budget does not use up what the next service's script may expand."""

    def __init__(self, limit: int = MAX_TOTAL_CHARS):
        self.limit = limit
        self.used = 0


@dataclass
class SimpleCommand:
    words: list[str]
    after: str  # the operator that ended it: ";", "&&", "||", "|", "&" or ""
    before: str = ""  # the operator before it
    assignments: dict[str, str] = field(default_factory=dict)


@dataclass
class Unwrapped:
    argv: list[str]
    environment: dict[str, str]
    via: str  # how the command was reached, for messages ("" when it is the argv itself)


_UNKNOWN = "\x00unknown\x00"  # a word whose value depends on something plan cannot know


def _expand(script: str, i: int, env: dict[str, str | None], spend) -> tuple[str, int]:
    """A ``$`` expansion starting at ``script[i]``; returns (value, next index) and ``spend``s its length."""
    value, end = _expansion_value(script, i, env)
    spend(len(value))
    return value, end


def _expansion_value(script: str, i: int, env: dict[str, str | None]) -> tuple[str, int]:
    nxt = script[i + 1:i + 2]
    if nxt == "{":
        end = script.find("}", i + 2)
        if end < 0:
            raise ShellRefused("an unterminated ${...}")
        body = script[i + 2:end]
        match = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)(?:(:-|-)(.*))?", body, re.S)
        if not match:
            raise ShellRefused(f"the expansion ${{{body}}}")
        name, op, default = match.groups()
        value = env.get(name)
        if op and (value is None or (op == ":-" and value == "")):
            if "$" in default or "`" in default:
                raise ShellRefused(f"a nested expansion in ${{{body}}}")
            return default, end + 1
        return (_UNKNOWN + name if value is None else value), end + 1
    match = _VAR.match(script, i + 1)
    if match:
        value = env.get(match.group())
        return (_UNKNOWN + match.group() if value is None else value), match.end()
    if nxt in ("(",):
        raise ShellRefused("command substitution $(...)")
    if nxt and nxt in "@*#?$!0123456789-":
        raise ShellRefused(f"the special parameter ${nxt}")
    return "$", i + 1


def split_script(script: str, env: dict[str, str], budget: ExpansionBudget | None = None) -> list[SimpleCommand]:
    """The simple commands of a POSIX shell script, variables expanded from ``env``
    and the script's own assignments (in order); raises ShellRefused for any
    construct beyond lists, pipes and redirections, or for expansions past the budget."""
    budget = budget or ExpansionBudget()
    expanded = 0

    def spend(chars: int) -> None:
        nonlocal expanded
        expanded += chars
        if budget.used + expanded > budget.limit:
            raise ShellRefused(f"its variables expand past {budget.limit} characters")

    env = dict(env)
    commands: list[SimpleCommand] = []
    words: list[str] = []
    word: list[str] = []
    in_word = False
    split_candidates: set[int] = set()  # words that are a lone unquoted expansion
    before = ""
    i, n = 0, len(script)

    def end_word():
        nonlocal word, in_word
        if in_word:
            words.append("".join(word))
        word, in_word = [], False

    def end_command(op: str):
        nonlocal words, before, split_candidates
        end_word()
        if words:
            command = _simple(words, split_candidates, op, before, env)
            commands.append(command)
        elif op in ("&&", "||", "|"):
            raise ShellRefused(f"an empty command before {op}")
        words, split_candidates = [], set()
        before = op

    while i < n:
        c = script[i]
        if c in " \t":
            end_word()
            i += 1
        elif c == "\n":
            end_command(";")
            i += 1
        elif c == "#" and not in_word:
            while i < n and script[i] != "\n":
                i += 1
        elif c == "\\":
            if i + 1 < n and script[i + 1] == "\n":
                i += 2
                continue
            word.append(script[i + 1:i + 2])
            in_word = True
            i += 2
        elif c == "'":
            end = script.find("'", i + 1)
            if end < 0:
                raise ShellRefused("an unterminated ' quote")
            word.append(script[i + 1:end])
            in_word = True
            i = end + 1
        elif c == '"':
            i += 1
            in_word = True
            while True:
                if i >= n:
                    raise ShellRefused('an unterminated " quote')
                d = script[i]
                if d == '"':
                    i += 1
                    break
                if d == "\\" and i + 1 < n and script[i + 1] in '$`"\\\n':
                    word.append(script[i + 1])
                    i += 2
                elif d == "$":
                    value, i = _expand(script, i, env, spend)
                    word.append(value)
                elif d == "`":
                    raise ShellRefused("command substitution `...`")
                else:
                    word.append(d)
                    i += 1
        elif c == "$":
            if not in_word and (i + 1 >= n or script[i + 1] in "{" or _VAR.match(script, i + 1)):
                split_candidates.add(len(words))
            value, i = _expand(script, i, env, spend)
            word.append(value)
            in_word = True
        elif c == "`":
            raise ShellRefused("command substitution `...`")
        elif c in "()":
            raise ShellRefused("a subshell ( ... )")
        elif c in ";&|":
            op = script[i:i + 2] if script[i:i + 2] in ("&&", "||", ";;", "|&", "&>") else c
            if op == "&>":
                end_word()
                i = _skip_redirect_target(script, i + 2)
                continue
            if op in (";;", "|&"):
                raise ShellRefused(f"the operator {op}")
            end_command(op)
            i += len(op)
        elif c in "<>":
            if script[i:i + 2] == "<<":
                raise ShellRefused("a here-document")
            if script[i + 1:i + 2] == "(":
                raise ShellRefused("process substitution")
            # A redirection: an fd number glued to it belongs to it, not to the command.
            if in_word and "".join(word).isdigit():
                word, in_word = [], False
            end_word()
            j = i + 1
            if j < n and script[j] in ">&|":
                j += 1
            i = _skip_redirect_target(script, j)
        else:
            word.append(c)
            in_word = True
            i += 1
    end_command("")
    budget.used += expanded
    return commands


def _skip_redirect_target(script: str, j: int) -> int:
    n = len(script)
    while j < n and script[j] in " \t":
        j += 1
    if j >= n or script[j] in "\n;&|<>":
        raise ShellRefused("a redirection without a target")
    quote = None
    while j < n:
        c = script[j]
        if quote:
            if c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c in " \t\n;&|<>()":
            break
        elif c == "$" and script[j + 1:j + 2] == "(":
            raise ShellRefused("command substitution $(...)")
        j += 1
    return j


def _simple(words: list[str], split_candidates: set[int], op: str, before: str,
            env: dict[str, str]) -> SimpleCommand:
    expanded: list[str] = []
    for n, word in enumerate(words):
        if n in split_candidates and _UNKNOWN not in word:
            expanded += word.split()  # an unquoted expansion splits on whitespace
        else:
            expanded.append(word)
    assignments: dict[str, str] = {}
    first = 0
    while first < len(expanded) and (match := _ASSIGNMENT.match(expanded[first])):
        assignments[match.group(1)] = match.group(2)
        first += 1
    expanded = expanded[first:]
    if expanded and expanded[0] in _UNSUPPORTED_WORDS:
        raise ShellRefused(f"the shell keyword or builtin {expanded[0]!r}")
    command = SimpleCommand(expanded, op, before, assignments)
    if not expanded:  # VAR=value alone sets a shell variable for the rest of the script
        env.update({k: v for k, v in assignments.items() if _UNKNOWN not in v})
        for k, v in assignments.items():
            if _UNKNOWN in v:
                env.pop(k, None)
    elif expanded[0] == "export":
        for item in expanded[1:]:
            if item.startswith("-"):
                continue
            if match := _ASSIGNMENT.match(item):
                if _UNKNOWN in match.group(2):
                    env.pop(match.group(1), None)
                else:
                    env[match.group(1)] = match.group(2)
    elif expanded[0] == "unset":
        for item in expanded[1:]:
            env.pop(item, None)
    return command


def strip_prefixes(argv: list[str], environment: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """``exec``, ``env [-u X] [-i] A=B ...`` and leading ``A=B`` words in front of a command."""
    env = dict(environment)
    i, n = 0, len(argv)
    while i < n:
        head = argv[i].rsplit("/", 1)[-1]
        if head == "exec":
            i += 1
            while i < n and argv[i].startswith("-"):
                i += 2 if (argv[i] == "-a" and i + 1 < n) else 1
        elif head == "env":
            i += 1
            while i < n:
                word = argv[i]
                if word in ("-i", "--ignore-environment", "-"):
                    env = {}
                    i += 1
                elif word in ("-u", "--unset") and i + 1 < n:
                    env.pop(argv[i + 1], None)
                    i += 2
                elif word.startswith("--unset="):
                    env.pop(word.split("=", 1)[1], None)
                    i += 1
                elif word.startswith("-"):
                    raise ShellRefused(f"the env option {word[:40]}")
                elif match := _ASSIGNMENT.match(word):
                    env[match.group(1)] = match.group(2)
                    i += 1
                else:
                    break
        elif match := _ASSIGNMENT.match(argv[i]):
            env[match.group(1)] = match.group(2)
            i += 1
        else:
            break
    return list(argv[i:]), env


def shell_script(argv: list[str]) -> tuple[str, str] | None:
    """(shell, script) when ``argv`` runs ``SHELL [options] -c SCRIPT``, else None."""
    if not argv:
        return None
    shell = argv[0].rsplit("/", 1)[-1]
    rest = argv[1:]
    if shell == "busybox" and rest and rest[0] in SHELLS:
        shell, rest = rest[0], rest[1:]
    if shell not in SHELLS:
        return None
    has_c = False
    i = 0
    while i < len(rest) and rest[i][:1] in ("-", "+") and rest[i] not in ("-", "--"):
        option = rest[i]
        if option in ("-o", "+o", "-O", "+O"):
            i += 2
            continue
        if not option.startswith("--") and "c" in option[1:]:
            has_c = True
        i += 1
    if i < len(rest) and rest[i] == "--":
        i += 1
    if not has_c:
        return None
    if i >= len(rest):
        raise ShellRefused(f"{shell} -c without a script")
    return shell, rest[i]


def unwrap(argv: list[str], environment: dict[str, str], is_program,
           budget: ExpansionBudget | None = None) -> Unwrapped:
    """The command ``is_program`` recognises, out of whatever wraps it.

    ``is_program(words)`` says whether one command's words run a program plan
    checks. Without a shell, the argv is used as it is (``exec``/``env``/
    assignments in front stripped). With ``sh -c SCRIPT`` the script is split
    into simple commands; exactly one may run such a program, it must not be
    conditional on a failure (``||``), and the commands before it may only be
    harmless ones or variable settings. ``budget`` caps what the script's
    variables expand to (share one across a plan; None: a fresh one)."""
    found = shell_script(argv)
    if found is None:
        stripped, env = strip_prefixes(argv, environment)
        via = "" if stripped == argv else "env/exec prefix"
        return Unwrapped(stripped, env, via)
    shell, script = found
    commands = split_script(script, environment, budget)
    env = dict(environment)
    chosen: SimpleCommand | None = None
    unsafe: str | None = None  # the first command before the program that is not known to be harmless
    for command in commands:
        words, command_env = strip_prefixes(command.words, {**env, **command.assignments})
        if words and words[0].rsplit("/", 1)[-1] in SHELLS and shell_script(words):
            raise ShellRefused("a shell inside the shell script")
        if words and is_program(words):
            if chosen is not None:
                raise ShellRefused("it starts more than one program that plan checks; give each its own service")
            if command.before == "||":
                raise ShellRefused("the program runs only when the command before it fails (||)")
            unknown = [w for w in words if _UNKNOWN in w]
            if unknown:
                name = unknown[0].split(_UNKNOWN, 1)[1].split()[0] if _UNKNOWN in unknown[0] else "?"
                raise ShellRefused(f"its command uses ${_VAR.match(name).group() if _VAR.match(name) else name}, "
                                   "which the service's environment does not set")
            chosen = command
            result = Unwrapped(words, {k: v for k, v in command_env.items() if _UNKNOWN not in v},
                               f"{shell} -c script")
            continue
        if chosen is None:
            _note_setting(command, env)
            if words and words[0] not in HARMLESS and words[0] not in ("export", "unset") and unsafe is None:
                unsafe = words[0]
    if chosen is not None and unsafe is not None:
        raise ShellRefused(f"it runs {unsafe!r} before the program; plan cannot tell what that "
                           "changes (move it into the image or an entrypoint of its own)")
    if chosen is None:
        # The script word itself and what follows it in argv: compose split a string
        # command into words, so `sh -c` got only the first one as its script.
        if is_program(argv[argv.index(script):]):
            raise ShellRefused(f"{shell} -c runs only its script ({script[:40]!r}); the words after it are the "
                               "script's positional parameters, not a command (with an entrypoint of "
                               "[sh, -c], give command as a list of one string)")
        return Unwrapped(argv, environment, "")
    return result


def _note_setting(command: SimpleCommand, env: dict[str, str]) -> None:
    """The exported environment the next commands see, after ``export``/``unset``/``A=B``."""
    words = command.words
    if not words:
        # A plain assignment changes the environment only for a variable already exported.
        env.update({k: v for k, v in command.assignments.items() if k in env})
    elif words[0] == "export":
        for item in words[1:]:
            if match := _ASSIGNMENT.match(item):
                env[match.group(1)] = match.group(2)
    elif words[0] == "unset":
        for item in words[1:]:
            env.pop(item, None)
