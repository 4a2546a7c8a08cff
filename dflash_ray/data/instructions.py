"""An instruction prompt set for regenerating answers with a real small target and training a drafter on them.

Prompts are assembled by code from hand-written parts (task kinds, topics, templates, length cues, follow-ups,
system prompts); nothing is downloaded. Assistant turns are placeholders that `regenerate` replaces with the
target's own answers. Every user turn asks for a short answer (a length cue), since the target may run on CPUs.

The held-out split is kept apart by construction: it draws only HELDOUT_KINDS x HELDOUT_TOPICS, and the train
split only TRAIN_KINDS x TRAIN_TOPICS (both pairs disjoint, and no template of one split names a topic of the
other), so a held-out figure measures generalisation to unseen tasks and subjects, not memory of prompts.
Rows carry their "kind" and "topic" beside "id" and "conversations" (extra fields the pipeline keeps).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

__all__ = ["PLACEHOLDER", "LENGTH_CUES", "SPLITS", "TRAIN_KINDS", "HELDOUT_KINDS", "TRAIN_TOPICS", "HELDOUT_TOPICS",
           "SYSTEM_PROMPTS", "write_instructions"]

# any string is a valid assistant content for formats.iter_conversations; a visible marker, not "", so a row
# that skipped regeneration is easy to spot
PLACEHOLDER = "(to be regenerated)"
SPLITS = ("train", "heldout")
MULTI_TURN_SHARE = 0.3
SYSTEM_SHARE = 0.1
_DEDUPE_TRIES = 64  # redraws of a conversation whose first user turn was already written

_NUMBERS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}

# Every user turn contains one of these (case-insensitive); the test holds the generator to it.
LENGTH_CUES = tuple(
    [f"{w} sentence" for w in ("one", "single")]
    + [f"{_NUMBERS[n]} sentences" for n in (2, 3, 4)]
    + [f"{_NUMBERS[n]} {unit}" for n in (2, 3, 4, 5) for unit in
       ("bullet points", "numbered steps", "questions", "quiz questions", "short lines")]
    + [f"under {n} words" for n in (30, 40, 50, 60, 80, 100)]
    + [f"under {n} lines" for n in (8, 10, 12, 15)]
    + ["one-sentence", "haiku", "two-line rhyme", "four-line poem", "five-line limerick", "one short paragraph"])

SYSTEM_PROMPTS = ("You are a concise assistant.", "You are a helpful assistant. Keep answers short.",
                  "You are a friendly tutor who answers briefly.", "Answer clearly and briefly.")

# ------------------------------------------------------------------------------------------------ topics
# Grouped by domain so "compare" can pair two topics of one domain. Held-out topics share no word with these.
_TRAIN_DOMAINS = {
    "science": ("photosynthesis", "black holes", "the water cycle", "plate tectonics", "DNA", "magnetism",
                "the periodic table", "climate change", "vaccines", "electricity"),
    "history": ("the Roman Empire", "the printing press", "the Industrial Revolution", "the Apollo Moon landing",
                "the French Revolution", "the Great Wall of China", "the Vikings", "ancient Greece"),
    "cooking": ("sourdough bread", "homemade pasta", "cooking with spices", "baking cookies", "vegetable soup",
                "quick breakfasts", "knife skills", "vegetarian cooking"),
    "sport": ("marathon running", "football", "swimming", "tennis", "cycling", "yoga", "basketball"),
    "travel": ("train travel", "packing light", "visiting Japan", "camping", "road trips", "budget travel"),
    "money": ("saving money", "compound interest", "monthly budgeting", "credit cards", "inflation",
              "starting a small business"),
    "health": ("sleep", "drinking enough water", "stretching", "managing stress", "healthy snacks",
               "daily walking"),
    "technology": ("smartphones", "password security", "cloud storage", "electric cars", "video games",
                   "the internet", "artificial intelligence", "solar panels"),
    "nature": ("honeybees", "rainforests", "whales", "volcanoes", "migrating birds", "houseplants", "mushrooms",
               "ocean tides"),
    "arts": ("jazz", "watercolour painting", "photography", "poetry", "theatre", "learning the guitar",
             "sculpture"),
}
TRAIN_TOPICS = tuple(t for ts in _TRAIN_DOMAINS.values() for t in ts)
HELDOUT_TOPICS = ("lighthouses", "origami", "glaciers", "chess", "kite flying", "the Silk Road", "fermented foods",
                  "submarines", "coral reefs", "the pyramids of Giza", "rock climbing", "insurance", "dreams",
                  "3D printing", "opera")
_DOMAIN = {t: d for d, ts in _TRAIN_DOMAINS.items() for t in ts}


# ------------------------------------------------------------------------------------------------ helpers
def _pick(rng: np.random.Generator, seq):
    return seq[int(rng.integers(len(seq)))]


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def _a(phrase: str) -> str:
    """The phrase with "a" or "an" before it (by its first letter: enough for the hand-written words here)."""
    return ("an " if phrase[:1].lower() in "aeiou" else "a ") + phrase


def _n(rng: np.random.Generator, lo: int = 2, hi: int = 5) -> str:
    return _NUMBERS[int(rng.integers(lo, hi + 1))]


# ------------------------------------------------------------------------------------------ train kinds
def _explain(rng, topic):
    cue = _pick(rng, (f"in {_n(rng, 2, 3)} sentences", "in under 60 words", "in one short paragraph",
                      "in under 50 words"))
    return _pick(rng, (f"Explain {topic} {cue}.", f"Can you explain {topic} to a beginner, {cue}?",
                       f"What is the main idea behind {topic}? Answer {cue}.",
                       f"Give a simple explanation of {topic} {cue}.",
                       f"Tell me why {topic} matters, {cue}.",
                       f"I keep hearing about {topic}. What is it? Please answer {cue}."))


def _list(rng, topic):
    n = _n(rng, 3, 5)
    what = _pick(rng, ("facts about", "key terms related to", "common misconceptions about",
                       "surprising things about", "questions a beginner might ask about", "useful tips about"))
    return _pick(rng, (f"List {n} {what} {topic}, as {n} bullet points.",
                       f"Give me {n} {what} {topic}. Use {n} bullet points, one short line each.",
                       f"Write {n} bullet points of {what} {topic}.",
                       f"In {n} bullet points, name {what} {topic}."))


def _compare(rng, topic):
    other = _pick(rng, [t for t in _TRAIN_DOMAINS[_DOMAIN[topic]] if t != topic])
    cue = _pick(rng, (f"in {_n(rng, 2, 3)} sentences", "in under 60 words", "in under 80 words"))
    return _pick(rng, (f"Compare {topic} and {other} {cue}.",
                       f"What do {topic} and {other} have in common, and how do they differ? Answer {cue}.",
                       f"How is {topic} different from {other}? Reply {cue}.",
                       f"Which is easier for a beginner to learn about: {topic} or {other}? Explain {cue}."))


_REWRITE_SENTENCES = ("I think {topic} is boring and nobody should bother with it.",
                      "The meeting about {topic} has been moved to Friday afternoon.",
                      "Please read the notes on {topic} before class tomorrow.",
                      "The report on {topic} was late again, which is a real problem.",
                      "You forgot to bring the book about {topic} that you promised me.",
                      "Our club will talk about {topic} next week, so come along.",
                      "{Topic} is much more interesting than most people think.",
                      "We need someone to give a short talk on {topic} by Monday.")
_TONES = ("a more formal tone", "a friendlier tone", "a more polite tone", "a more enthusiastic tone",
          "a casual tone", "the style of a news headline", "a calmer tone", "a more confident tone")


def _rewrite(rng, topic):
    s = _pick(rng, _REWRITE_SENTENCES).format(topic=topic, Topic=_cap(topic))
    tone = _pick(rng, _TONES)
    return _pick(rng, (f'Rewrite this sentence in {tone}, keeping it to one sentence: "{s}"',
                       f'Here is a sentence: "{s}" Rewrite it in {tone}. Reply with a single sentence.',
                       f'Change this sentence to {tone}, in under 30 words: "{s}"'))


_PARAGRAPH_PARTS = ("{Topic} has a longer history than many people expect.",
                    "Experts still disagree about some of the details of {topic}.",
                    "Many beginners first learn about {topic} from books, videos or local clubs.",
                    "Interest in {topic} has grown steadily over the last twenty years.",
                    "A common mistake is to assume that {topic} is simple.",
                    "Good teachers explain {topic} with clear, everyday examples.",
                    "Some people find {topic} relaxing, while others find it hard work.",
                    "Schools in several countries now include {topic} in their lessons.",
                    "Learning the basics of {topic} takes a few weeks of regular practice.",
                    "Newspapers often get the facts about {topic} slightly wrong.",
                    "The cost of getting involved in {topic} varies a great deal.",
                    "Most people who try {topic} say they wish they had started sooner.")


def _summarise(rng, topic):
    k = int(rng.integers(3, 6))
    idx = rng.choice(len(_PARAGRAPH_PARTS), size=k, replace=False)
    para = " ".join(_PARAGRAPH_PARTS[int(i)].format(topic=topic, Topic=_cap(topic)) for i in idx)
    cue = _pick(rng, ("in one sentence", "in under 30 words", "in two sentences", "in a single sentence"))
    return _pick(rng, (f"Summarise this paragraph {cue}:\n\n{para}",
                       f"{para}\n\nSummarise the text above {cue}.",
                       f"Give the main point of the following {cue}.\n\n{para}"))


# (what it does, function names, parameter names); {n}, {a}, {b}, {x}, {y} are filled per prompt
_CODE_TASKS = (
    ("reverses a string", ("reverse_text", "flip", "backwards"), ("text", "s", "word")),
    ("counts the vowels in a string", ("count_vowels", "vowel_count", "num_vowels"), ("text", "word", "s")),
    ("checks whether a word is a palindrome", ("is_palindrome", "palindrome", "reads_same"), ("word", "text")),
    ("returns the largest number in a list", ("largest", "max_value", "biggest"), ("numbers", "values", "xs")),
    ("prints the numbers 1 to {n}, but prints '{a}' for multiples of {x}, '{b}' for multiples of {y}, "
     "and '{a}{b}' for multiples of both", ("fizzbuzz", "play_game", "count_off"), ("limit", "n")),
    ("returns the sum of the even numbers in a list", ("sum_even", "even_total", "add_evens"), ("numbers", "items")),
    ("counts the words in a sentence", ("word_count", "count_words"), ("sentence", "line", "text")),
    ("converts a temperature from Celsius to Fahrenheit", ("c_to_f", "to_fahrenheit"), ("celsius", "degrees", "c")),
    ("returns the first {n} square numbers as a list", ("squares", "first_squares"), ("count", "n", "how_many")),
    ("removes duplicates from a list while keeping the original order", ("dedupe", "unique_items", "remove_repeats"),
     ("items", "values", "things")),
    ("capitalises the first letter of every word in a string", ("title_words", "capitalise_all"), ("text", "s")),
    ("returns the factorial of a whole number", ("factorial", "fact"), ("n", "number")),
    ("returns how many times a given letter appears in a string", ("count_letter", "letter_count"),
     ("text, letter", "word, ch", "s, c")),
    ("returns the average of a list of numbers, or 0 for an empty list", ("average", "mean_of"),
     ("numbers", "scores", "values")),
)
_FIZZ = ("Fizz", "Buzz", "Ping", "Pong", "Tick", "Tock", "Zip", "Zap")


def _code(rng, topic):
    what, names, params = _pick(rng, _CODE_TASKS)
    a, b = (str(w) for w in rng.choice(_FIZZ, size=2, replace=False))
    x, y = (int(v) for v in rng.choice([2, 3, 4, 5, 7], size=2, replace=False))
    what = what.format(n=int(rng.integers(10, 31)), a=a, b=b, x=x, y=y)
    sig = f"{_pick(rng, names)}({_pick(rng, params)})"
    cue = _pick(rng, ("Keep it under 8 lines", "Keep it under 10 lines", "Use under 12 lines of code",
                      "Keep the code under 15 lines"))
    # the topic gives the request a setting, so train and held-out code prompts stay apart like the rest
    setting = _pick(rng, (f"I am writing a small app about {topic}.", f"For a school project on {topic}:",
                          f"I run a website about {topic}.", ""))
    body = _pick(rng, (f"Write a Python function `{sig}` that {what}.",
                       f"Please write a short Python function called `{sig}` which {what}.",
                       f"In Python, write `{sig}`: it {what}."))
    tail = _pick(rng, (f"{cue} and add one example call.", f"{cue}.", f"{cue}, with no explanation."))
    return " ".join(p for p in (setting, body, tail) if p)


_NAMES = ("Amira", "Ben", "Carlos", "Dana", "Eli", "Fatima", "George", "Hana", "Ivan", "Jess", "Kofi", "Lena",
          "Mateo", "Nina", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Victor", "Wen", "Yusuf", "Zoe")
_VENUES = ("workshop", "club", "fair", "evening class", "exhibition", "festival")


def _arithmetic(rng, topic):
    name = _pick(rng, _NAMES)
    venue = _pick(rng, _VENUES)
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))  # noqa: E731
    cue = _pick(rng, ("Show your working in two sentences.", "Answer in under 40 words.",
                      "Give the answer and one line of working, in two sentences.", "Answer in one sentence."))
    t = int(rng.integers(6))
    if t == 0:
        n, p = r(2, 9), r(2, 15)
        note = _pick(rng, [v for v in (20, 50, 100, 200) if v > n * p] or [500])
        q = (f"{name} buys {n} tickets for {_a(venue)} on {topic} at {p} dollars each and pays with "
             f"a {note}-dollar note. How much change does {name} get?")
    elif t == 1:
        students, group = r(17, 60), r(3, 7)
        q = (f"A class studying {topic} has {students} students, split into groups of {group}. How many full "
             f"groups are there, and how many students are left over?")
    elif t == 2:
        pages, per_day = r(80, 400), r(8, 40)
        q = (f"{name} reads {per_day} pages a day of a book about {topic} that has {pages} pages. How many "
             f"days does it take to finish the book?")
    elif t == 3:
        sat, sun = r(40, 900), r(40, 900)
        q = (f"{_cap(_a(venue))} about {topic} had {sat} visitors on Saturday and {sun} on Sunday. How many "
             f"visitors came in total, and how many more came on the busier day?")
    elif t == 4:
        price, people, off = r(8, 60), r(3, 12), _pick(rng, (10, 15, 20, 25, 50))
        q = (f"A place at {_a(venue)} on {topic} costs {price} dollars. A group of {people} people gets {off}% off "
             f"the total. How much does the group pay?")
    else:
        minutes, sessions = r(10, 90), r(2, 7)
        q = (f"{name} spends {minutes} minutes learning about {topic} each session and has {sessions} sessions a week. "
             f"How many hours and minutes is that per week?")
    return _pick(rng, (f"{q} {cue}", f"Solve this word problem. {q} {cue}", f"Quick maths question: {q} {cue}"))


_RECIPIENTS = ("your manager", "a neighbour", "your landlord", "a teacher", "the local library", "an old friend",
               "a customer", "the town council", "your team", "a hotel manager", "your cousin", "a club secretary")
_PURPOSES = ("asking for advice about {topic}", "inviting them to a talk on {topic}",
             "thanking them for a book about {topic}", "suggesting a new club about {topic}",
             "apologising for missing a meeting about {topic}", "asking for a day off to attend an event on {topic}",
             "sharing a good article about {topic}", "asking whether they would help with a project on {topic}")


def _letter(rng, topic):
    form = _pick(rng, ("email", "letter", "note", "message"))
    to = _pick(rng, _RECIPIENTS)
    why = _pick(rng, _PURPOSES).format(topic=topic)
    cue = _pick(rng, ("Keep it under 80 words.", "Keep it under 60 words.", "Use under 100 words.",
                      "Keep it to three sentences."))
    tone = _pick(rng, ("", "polite ", "warm ", "brief ", "friendly ", "formal "))
    return _pick(rng, (f"Write a short {tone}{form} to {to}, {why}. {cue}",
                       f"Draft {_a(tone + form)} to {to} {why}. {cue}",
                       f"Help me write {_a(tone + form)} to {to}. I am {why}. {cue}"))


def _poem(rng, topic):
    mood = _pick(rng, ("", "cheerful ", "gentle ", "funny ", "thoughtful ", "quiet ", "playful "))
    return _pick(rng, (f"Write a {mood}haiku about {topic}.",
                       f"Write a {mood}four-line poem about {topic} with a simple rhyme.",
                       f"Write a {mood}two-line rhyme about {topic}.",
                       f"Compose a {mood}five-line limerick about {topic}.",
                       f"Can you write a {mood}four-line poem about {topic}? Make the lines rhyme in pairs.",
                       f"A {mood}haiku about {topic}, please."))


def _define(rng, topic):
    return _pick(rng, (f"Define {topic} in one sentence.", f"Give a one-sentence definition of {topic}.",
                       f"What does the term {topic} mean? Answer in under 30 words.",
                       f"Define {topic} in plain words in one sentence, then give one example in a second "
                       f"sentence. Two sentences in total.",
                       f"How would a dictionary define {topic}? Reply in a single sentence."))


def _how_to(rng, topic):
    n = _n(rng, 3, 5)
    goal = _pick(rng, (f"get started with {topic}", f"learn the basics of {topic}", f"teach a friend about {topic}",
                       f"plan a weekend project about {topic}", f"find reliable information on {topic}"))
    return _pick(rng, (f"How do I {goal}? Give {n} numbered steps.",
                       f"Explain in {n} numbered steps how to {goal}.",
                       f"What are {n} numbered steps to {goal}? Keep each step to one line.",
                       f"I want to {goal}. Give me a plan in {n} numbered steps."))


def _pros_cons(rng, topic):
    about = _pick(rng, (f"studying {topic}", f"making {topic} a school subject", f"a career connected to {topic}",
                        f"spending a weekend learning about {topic}", f"joining a club about {topic}"))
    return _pick(rng, (f"Give two pros and two cons of {about}, as four bullet points.",
                       f"What are the pros and cons of {about}? Answer in under 60 words.",
                       f"List the main advantage and the main disadvantage of {about}, in two sentences.",
                       f"Weigh up {about} in four bullet points, two for and two against."))


def _advice(rng, topic):
    time = _pick(rng, ("one hour", "two hours", "thirty minutes", "one evening"))
    feeling = _pick(rng, ("nervous", "bored", "confused", "excited", "overwhelmed"))
    cue = _pick(rng, ("in two sentences", "in three sentences", "in under 50 words", "in one sentence"))
    return _pick(rng, (f"I want to learn more about {topic} but only have {time} a week. What should I do? "
                       f"Answer {cue}.",
                       f"My friend feels {feeling} about {topic}. What advice would you give, {cue}?",
                       f"What is one piece of advice for someone new to {topic}? Answer {cue}.",
                       f"I feel {feeling} about {topic}. Any advice? Please reply {cue}.",
                       f"What should I avoid when I start with {topic}? Answer {cue}."))


# ---------------------------------------------------------------------------------------- held-out kinds
def _story_opening(rng, topic):
    genre = _pick(rng, ("mystery", "adventure", "science fiction", "ghost", "comic", "fairy-tale"))
    cue = _pick(rng, ("in two sentences", "in three sentences", "in under 60 words", "in under 50 words"))
    return _pick(rng, (f"Write the opening of {_a(genre)} story about {topic}, {cue}.",
                       f"Begin {_a(genre)} story that involves {topic}. Write it {cue}.",
                       f"Give me the first lines of {_a(genre)} tale set around {topic}, {cue}."))


def _interview_questions(rng, topic):
    n = _n(rng, 3, 5)
    who = _pick(rng, ("an expert on", "a beginner in", "a teacher of", "a writer about", "a fan of"))
    where = _pick(rng, ("for a podcast", "for a school newspaper", "for a radio show", "for a local magazine"))
    return _pick(rng, (f"Write {n} questions to ask {who} {topic} in an interview {where}.",
                       f"I am interviewing {who} {topic} {where}. Suggest {n} questions, one line each.",
                       f"Suggest {n} questions to ask {who} {topic}, numbered."))


def _analogy(rng, topic):
    cue = _pick(rng, ("in two sentences", "in under 50 words", "in one sentence", "in three sentences"))
    frame = _pick(rng, ("everyday life", "a kitchen", "a busy town", "a family", "a garden", "a bus journey"))
    return _pick(rng, (f"Explain {topic} with an analogy from {frame}, {cue}.",
                       f"Give one analogy involving {frame} that makes {topic} easy to grasp. Answer {cue}.",
                       f"{_cap(topic)} is like what? Answer with an analogy {cue}."))


def _quiz_questions(rng, topic):
    n = _n(rng, 2, 5)
    style = _pick(rng, ("multiple-choice", "true-or-false", "short-answer"))
    return _pick(rng, (f"Write {n} quiz questions about {topic}, {style}, with answers.",
                       f"Make {n} quiz questions ({style}) on {topic} for a class.",
                       f"Create {n} quiz questions, {style}, to test what someone knows about {topic}."))


_BUILDERS = {
    "explain": _explain, "list": _list, "compare": _compare, "rewrite": _rewrite, "summarise": _summarise,
    "code": _code, "arithmetic": _arithmetic, "letter": _letter, "poem": _poem, "define": _define,
    "how_to": _how_to, "pros_cons": _pros_cons, "advice": _advice,
    "story_opening": _story_opening, "interview_questions": _interview_questions, "analogy": _analogy,
    "quiz_questions": _quiz_questions,
}
HELDOUT_KINDS = ("story_opening", "interview_questions", "analogy", "quiz_questions")
TRAIN_KINDS = tuple(k for k in _BUILDERS if k not in HELDOUT_KINDS)

# Second user turns. Each names a length too; kind-specific ones where a generic one would not fit.
_FOLLOW_UPS = ("Make it shorter, in one sentence.", "Now explain it to a ten-year-old, in two sentences.",
               "Give one more example, in one sentence.", "Turn that into a single sentence.",
               "Say that again in under 30 words.", "Which part matters most? Answer in one sentence.",
               "Put that as three bullet points.", "Can you make it simpler, in under 40 words?")
_KIND_FOLLOW_UPS = {
    "code": ("Now add a short docstring, keeping it under 12 lines.", "Explain how it works in two sentences.",
             "Rewrite it in a different way, in under 10 lines."),
    "arithmetic": ("Now double the first number and solve it again, in two sentences.",
                   "Explain the method in one sentence.", "Check the answer another way, in under 40 words."),
    "poem": ("Now turn it into a haiku.", "Write a two-line rhyme on the same theme.",
             "Make it sadder, as a four-line poem."),
    "letter": ("Make it more formal and keep it under 60 words.", "Write a one-sentence subject line for it.",
               "Make it friendlier, under 50 words."),
}


def _user_turns(rng, kind: str, topic: str) -> list[str]:
    first = _BUILDERS[kind](rng, topic)
    if rng.random() >= MULTI_TURN_SHARE:
        return [first]
    pool = _KIND_FOLLOW_UPS.get(kind, ()) + _FOLLOW_UPS
    return [first, _pick(rng, pool)]


def write_instructions(path: str | os.PathLike, num_conversations: int, *, seed: int = 0,
                       split: str = "train") -> Path:
    """Write `num_conversations` JSONL rows {"id", "kind", "topic", "conversations"} of one split ("train":
    TRAIN_KINDS x TRAIN_TOPICS, "heldout": HELDOUT_KINDS x HELDOUT_TOPICS), assistant turns PLACEHOLDER.
    Deterministic given (num_conversations, seed, split); first user turns are distinct while redraws allow."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, not {split!r}")
    kinds, topics = (TRAIN_KINDS, TRAIN_TOPICS) if split == "train" else (HELDOUT_KINDS, HELDOUT_TOPICS)
    # the split is part of the seed: the two splits are independent streams for one seed
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), SPLITS.index(split)]))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    seen: set[str] = set()
    with open(path, "w", encoding="utf-8") as f:
        for i in range(int(num_conversations)):
            for _ in range(_DEDUPE_TRIES):
                kind, topic = _pick(rng, kinds), _pick(rng, topics)
                turns = _user_turns(rng, kind, topic)
                if turns[0] not in seen:
                    break
            seen.add(turns[0])
            conv = [{"role": "system", "content": _pick(rng, SYSTEM_PROMPTS)}] if rng.random() < SYSTEM_SHARE else []
            for text in turns:
                conv += [{"role": "user", "content": text}, {"role": "assistant", "content": PLACEHOLDER}]
            row = {"id": f"instr-{split}-{i}", "kind": kind, "topic": topic, "conversations": conv}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path
