"""Instruction makers, one per kind of request Spec-Bench measures (never its prompts): writing, roleplay,
reasoning, math, coding, extraction, STEM and humanities questions, translation into English, summarisation
and question answering over long passages, and short factual questions. Each maker takes a seeded
`random.Random` and the `Material` read once from this machine, and returns the text of one user turn."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from . import material

WRITING_FORMS = (
    "a short story", "a poem", "a haiku", "a formal email", "a friendly letter", "a product description",
    "a blog post", "a limerick", "a persuasive essay", "a short speech", "a diary entry", "a news article",
    "a dialogue between two friends", "a motivational message", "a travel blog post", "a cover letter",
    "a movie review", "a recipe introduction", "a song chorus", "an opening paragraph for a novel",
)  # fmt: skip
TOPICS = (
    "a rainy afternoon in a small town", "learning to ride a bicycle", "the first day at a new job", "a lost cat",
    "the ocean at night", "a robot who wants to paint", "recycling at home", "a trip to the mountains",
    "the importance of sleep", "a library that never closes", "friendship", "autumn leaves", "a busy kitchen",
    "space exploration", "a garden in spring", "a village festival", "saving money", "learning a new language",
    "a broken umbrella", "the history of bread", "a city without cars", "an old lighthouse", "climate change",
    "a chess tournament", "working from home", "a time traveller's mistake", "healthy breakfast ideas",
    "a volunteer day at the park", "a thunderstorm", "the joy of reading", "a trip to Hawaii", "electric cars",
    "a new smartphone", "the first snow of winter", "a family reunion", "artificial intelligence in schools",
)  # fmt: skip
ROLES = (
    "a pirate captain", "a detective in 1920s London", "a medieval knight", "a friendly librarian",
    "a travel guide in Rome", "a chef in a busy restaurant", "Sherlock Holmes", "a customer service agent",
    "a fitness coach", "a startup founder pitching to investors", "a doctor explaining a diagnosis",
    "an astronaut on the Moon", "a wise old wizard", "a sports commentator", "a strict math teacher",
    "a tour guide at a museum", "a job interviewer", "a stand-up comedian", "a park ranger", "a robot butler",
)  # fmt: skip
SITUATIONS = (
    "Introduce yourself and describe your day.", "A visitor asks you for advice. What do you tell them?",
    "Explain your job to a child.", "Something has gone wrong. How do you react?",
    "Someone asks you what you think of smartphones.", "Give a short speech to encourage your team.",
    "Describe the most interesting thing that happened to you this week.", "Answer: what makes you happy?",
)  # fmt: skip
ADVICE = (
    "staying focused while studying", "preparing for a job interview", "keeping a plant alive", "running a first 5k",
    "writing clean Python code", "saving energy at home", "making new friends in a new city", "learning to cook",
    "planning a trip on a budget", "getting better sleep", "giving a good presentation", "reducing stress",
    "organising a small team", "debugging a program", "writing a clear email", "starting a vegetable garden",
)  # fmt: skip
STEM = (
    "photosynthesis", "the water cycle", "black holes", "vaccines", "plate tectonics", "the greenhouse effect",
    "DNA replication", "Newton's laws of motion", "entropy", "how a transistor works", "binary numbers",
    "the Pythagorean theorem", "electric circuits", "how batteries store energy", "the immune system",
    "supply and demand", "inflation", "machine learning", "recursion", "hash tables", "the speed of light",
    "chemical bonds", "the periodic table", "prime numbers", "probability", "how GPS works", "nuclear fusion",
    "evolution by natural selection", "how the heart pumps blood", "tides", "sound waves", "compound interest",
)  # fmt: skip
HUMANITIES = (
    "the French Revolution", "the Renaissance", "the Industrial Revolution", "the Roman Empire", "democracy",
    "the Cold War", "Shakespeare's plays", "impressionist painting", "the printing press", "the Silk Road",
    "existentialism", "utilitarianism", "the causes of World War I", "ancient Egypt", "the scientific method",
    "the role of museums", "social media and society", "the history of jazz", "human rights", "globalisation",
)  # fmt: skip
AUDIENCES = ("a child", "a beginner", "a high school student", "an expert", "a busy manager")
CODING_TASKS = (
    "reverses a linked list", "checks whether a string is a palindrome", "finds the n-th Fibonacci number",
    "merges two sorted lists", "counts the words in a text file", "removes duplicates from a list",
    "implements binary search", "finds the longest common prefix of a list of strings", "sorts a list with quicksort",
    "validates an email address", "computes the factorial of a number", "finds the most frequent element",
    "converts Roman numerals to integers", "checks whether two strings are anagrams", "flattens a nested list",
    "implements a stack with push and pop", "finds all prime numbers below n", "computes the GCD of two numbers",
)  # fmt: skip
LANGUAGES_CODE = ("Python", "Python", "Python", "JavaScript", "C++", "Java", "Rust", "Go", "SQL")
NAMES = ("Anna", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Lena", "Maya", "Omar")
ITEMS = ("apples", "pencils", "books", "stickers", "cookies", "marbles", "tickets", "notebooks", "oranges", "cards")


@dataclass
class Material:
    """What the makers draw from, read once."""

    objects: list[tuple[str, str]] = field(default_factory=material.documented_objects)
    messages: dict[str, list[tuple[str, str]]] = field(
        default_factory=lambda: {code: material.translated_messages(code) for code in material.LANGUAGES}
    )
    man_pages: list[str] = field(default_factory=material.man_page_names)
    countries: list[str] = field(default_factory=material.countries)

    def __post_init__(self):
        self.messages = {code: pairs for code, pairs in self.messages.items() if pairs}
        self.paragraphs = [(name, p) for name, doc in self.objects for p in material.prose_paragraphs(doc)]
        self._rendered: dict[str, str | None] = {}

    def passage(self, rng: random.Random, min_words: int, max_words: int) -> tuple[str, str]:
        """(title, text) of a long passage: a manual page's leading sections, or joined stdlib docs."""
        for _ in range(20):
            if self.man_pages and rng.random() < 0.7:
                path = rng.choice(self.man_pages)
                if path not in self._rendered:
                    self._rendered[path] = material.render_man_page(path)
                text = self._rendered[path]
                if text and len(text.split()) >= min_words:
                    return re.sub(r"\.\w+\.gz$", "", path.rsplit("/", 1)[-1]), material.man_passage(
                        text, min_words, max_words
                    )
            else:
                name, doc = rng.choice(self.objects)
                if len(doc.split()) >= min_words:
                    return name, " ".join(doc.split()[:max_words])
        name, doc = rng.choice(self.paragraphs)
        return name, doc


def writing(rng: random.Random, m: Material) -> str:
    length = rng.choice(("", " in about 150 words", " in three paragraphs", ", keep it short"))
    return f"Write {rng.choice(WRITING_FORMS)} about {rng.choice(TOPICS)}{length}."


def roleplay(rng: random.Random, m: Material) -> str:
    return f"Pretend to be {rng.choice(ROLES)}. {rng.choice(SITUATIONS)}"


def reasoning(rng: random.Random, m: Material) -> str:
    a, b, c = rng.sample(NAMES, 3)
    x, y = rng.randint(2, 9), rng.randint(10, 40)
    return rng.choice(
        (
            f"{a} is taller than {b}, and {b} is taller than {c}. Who is the shortest? Explain your reasoning.",
            f"If it takes {x} machines {x} minutes to make {x} widgets, how long would it take {y} machines to make "
            f"{y} widgets?",
            f"{a} says {b} is lying. {b} says {c} is lying. {c} says both {a} and {b} are lying. Who tells the truth?",
            f"A bat and a ball cost ${x}.10 in total. The bat costs ${x} more than the ball. How much does the ball "
            "cost?",
            f"There are {y} people in a room and everyone shakes hands with everyone else once. How many handshakes "
            "are there?",
            f"All {rng.choice(ITEMS)} in the box are red. Some red things are heavy. Does it follow that some "
            f"{rng.choice(ITEMS)} are heavy? Explain.",
            f"You overtake the person in {rng.choice(('second', 'third', 'last'))} place in a race. What place are "
            "you in now?",
        )
    )


def math(rng: random.Random, m: Material) -> str:
    name, other, item = rng.choice(NAMES), rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = rng.randint(3, 60), rng.randint(2, 12), rng.randint(2, 9)
    price, hours, speed = rng.randint(2, 25), rng.randint(2, 9), rng.randint(20, 90)
    problem = rng.choice(
        (
            f"{name} has {a} {item}. {other} gives {name} {b} boxes with {c} {item} in each. How many {item} does "
            f"{name} have now?",
            f"A shop sells {item} for ${price} each. {name} buys {b} of them and pays with a ${price * b + a} bill. "
            f"How much change does {name} get?",
            f"A train travels at {speed} km per hour for {hours} hours. How far does it go?",
            f"{name} reads {b} pages every day. How many days does {name} need to finish a book of {b * a} pages?",
            f"A rectangle is {a} cm long and {b} cm wide. What are its area and its perimeter?",
            f"{name} saves ${price} a week. How many weeks until {name} has ${price * a}?",
            f"There are {a} students in a class and {b} of them are absent. The rest sit in rows of {c}. How many "
            "full rows are there?",
            f"{name} earns ${price * 2} an hour and works {hours} hours a day for {b} days. After spending "
            f"${a} on food, how much is left?",
            f"A recipe needs {c} eggs for {b} people. How many eggs are needed for {b * c} people?",
            f"Solve for x: {c}x + {a} = {a + c * b}.",
        )
    )
    return rng.choice(("", "Solve step by step: ", "Answer the math question: ", "")) + problem


def coding(rng: random.Random, m: Material) -> str:
    if rng.random() < 0.5:
        return f"Write a {rng.choice(LANGUAGES_CODE)} function that {rng.choice(CODING_TASKS)}."
    qualname, doc = rng.choice(m.objects)
    summary = re.split(r"(?<=[.!?])\s", " ".join(doc.split("\n\n")[0].split()), maxsplit=1)[0]
    return rng.choice(
        (
            f"Write a Python function named `{qualname.rsplit('.', 1)[-1]}` that does the following: {summary}",
            f"Explain what `{qualname}` does in Python, with a short example.",
            f"Write a small Python program that uses `{qualname}` and explain what it prints.",
            f"Explain to a beginner how to use `{qualname}`.",
        )
    )


def extraction(rng: random.Random, m: Material) -> str:
    title, text = m.passage(rng, 120, 400)
    task = rng.choice(
        (
            "List every command-line option mentioned in the text with a one-line description, as a Markdown table.",
            "Extract the names of all programs, files and options in the text as a JSON list.",
            "Extract the key facts from the text as bullet points.",
            "Return a JSON object with the fields `name`, `purpose` and `options` for the tool described below.",
        )
    )
    return f"{task}\n\n{text}"


def stem(rng: random.Random, m: Material) -> str:
    return rng.choice(
        (
            f"Explain {rng.choice(STEM)} to {rng.choice(AUDIENCES)}.",
            f"What is {rng.choice(STEM)}? Give an example.",
            f"Describe {rng.choice(STEM)} and why it matters.",
        )
    )


def humanities(rng: random.Random, m: Material) -> str:
    return rng.choice(
        (
            f"Explain {rng.choice(HUMANITIES)} to {rng.choice(AUDIENCES)}.",
            f"What were the main effects of {rng.choice(HUMANITIES)}?",
            f"Write a short essay on {rng.choice(HUMANITIES)}.",
            f"Compare {rng.choice(HUMANITIES)} and {rng.choice(HUMANITIES)}.",
        )
    )


def translation(rng: random.Random, m: Material) -> str:
    code = rng.choice(sorted(m.messages))
    sentences = [rng.choice(m.messages[code])[1] for _ in range(rng.choice((1, 1, 2, 3)))]
    language = material.LANGUAGES[code]
    return rng.choice((f"Translate {language} to English: ", "Translate into English:\n", "")) + " ".join(sentences)


def asked(rng: random.Random, text: str, asks: tuple[str, ...], first: float = 0.7, label: str = "") -> str:
    """One of `asks` before `text` (with chance `first`), else after it (the text then led by `label`)."""
    ask = rng.choice(asks)
    return f"{ask}\n\n{text}" if rng.random() < first else f"{label}{text}\n\n{ask}"


def summarization(rng: random.Random, m: Material) -> str:
    title, text = m.passage(rng, 300, 850)
    asks = (
        "Summarize the following text.",
        "Summarize the following document in a few sentences.",
        "Write a one-paragraph summary of this article.",
        "What is this text about? Summarize it.",
    )
    return asked(rng, text, asks)


def rag(rng: random.Random, m: Material) -> str:
    title, text = m.passage(rng, 250, 750)
    question = rng.choice(
        (
            f"What is {title} used for?",
            "What does the text say about its options?",
            f"How do I use {title}? Answer from the passage.",
            "What is the main point of the passage?",
        )
    )
    return f"Answer the question using the passage below.\n\nPassage:\n{text}\n\nQuestion: {question}"


def qa(rng: random.Random, m: Material) -> str:
    country = rng.choice(m.countries)
    return rng.choice(
        (
            f"What is the capital of {country}?",
            f"What languages are spoken in {country}?",
            f"Tell me about the geography of {country}.",
            f"What is {country} known for?",
            f"Who invented {rng.choice(('the telephone', 'the light bulb', 'the printing press', 'the airplane'))}?",
            f"When did {rng.choice(HUMANITIES)} happen?",
        )
    )


MAKERS = {
    "writing": writing,
    "roleplay": roleplay,
    "reasoning": reasoning,
    "math": math,
    "coding": coding,
    "extraction": extraction,
    "stem": stem,
    "humanities": humanities,
    "translation": translation,
    "summarization": summarization,
    "rag": rag,
    "qa": qa,
}
# kinds and their shares of the instructions; "magpie" turns are the target's own (make_chat_data.py)
SHARES = {kind: 1.0 for kind in MAKERS} | {"summarization": 1.5, "rag": 1.5, "translation": 1.5, "magpie": 3.0}
FOLLOW_UPS = (
    "Can you make it shorter?",
    "Please explain that in more detail.",
    "Now rewrite your answer in a more formal tone.",
    "Can you give an example?",
    "Summarize your answer in one sentence.",
    "Turn your answer into a bulleted list.",
    "What would be a good title for this?",
    "Are you sure? Please check your answer.",
)


# ---- prose instructions: news and encyclopedia articles (material.wheel_prose), a run of their own ----


@dataclass
class Prose:
    """News stories and encyclopedia articles from PROSE_WHEEL's wheel at `wheel`, read once."""

    wheel: str

    def __post_init__(self):
        self.news, self.articles = material.wheel_prose(self.wheel)

    def passage(self, rng: random.Random, min_words: int, max_words: int) -> tuple[str, str]:
        """(title, text): whole paragraphs of one article, from a random one on (after its last paragraph, from its
        first), of about min..max words; the last one cut to the budget."""
        title, text = rng.choice(self.articles)
        paragraphs = text.split("\n\n")
        start, kept, words = rng.randrange(len(paragraphs)), [], 0
        for paragraph in paragraphs[start:] + paragraphs[:start]:
            count = len(paragraph.split())
            if words + count > max_words and words >= min_words:
                break
            kept.append(paragraph if words + count <= max_words else " ".join(paragraph.split()[: max_words - words]))
            words += min(count, max_words - words)
        return title, "\n\n".join(kept)


def news_summary(rng: random.Random, p: Prose) -> str:
    story = rng.choice(p.news)
    asks = (
        "Summarize the following news article.",
        "Write a short summary of this news story.",
        "Give me the main points of this article in a few sentences.",
        "Summarize this article in two sentences.",
    )
    return asked(rng, story, asks, label="Article: ")


def news_questions(rng: random.Random, p: Prose) -> str:
    question = rng.choice(
        (
            "What happened, according to the article?",
            "Who is involved, and what did they say or do?",
            "Where and when did this take place?",
            "What are the consequences described in the article?",
            "What numbers does the article report, and what do they measure?",
        )
    )
    return f"Read the news article and answer the question.\n\nArticle: {rng.choice(p.news)}\n\nQuestion: {question}"


def news_writing(rng: random.Random, p: Prose) -> str:
    opening = re.split(r"(?<=[.!?]) ", rng.choice(p.news), maxsplit=1)[0]
    return rng.choice(
        (
            f"Write a short news report that begins with this sentence: {opening}",
            f"Write a headline and a three-paragraph news story about this: {opening}",
        )
    )


def wiki_summary(rng: random.Random, p: Prose) -> str:
    title, text = p.passage(rng, 300, 800)
    return asked(rng, text, ("Summarize the following text.", f"Summarize this passage about {title}.", "TL;DR:"), 0.6)


def wiki_rag(rng: random.Random, p: Prose) -> str:
    title, text = p.passage(rng, 200, 700)
    question = rng.choice(
        (
            f"What is {title}?",
            f"What does the passage say about the history of {title}?",
            "What are the key facts in this passage?",
            f"Why is {title} important, according to the passage?",
            "Which people, places or dates does the passage mention?",
        )
    )
    return f"Answer the question based on the passage.\n\nPassage: {text}\n\nQuestion: {question}"


def wiki_qa(rng: random.Random, p: Prose) -> str:
    title = rng.choice(p.articles)[0]
    return rng.choice(
        (
            f"What is {title}?",
            f"Tell me about {title}.",
            f"Give me a short history of {title}.",
            f"Explain {title} to {rng.choice(AUDIENCES)}.",
            f"What are three interesting facts about {title}?",
        )
    )


PROSE_MAKERS = {
    "news summary": news_summary,
    "news questions": news_questions,
    "news writing": news_writing,
    "wiki summary": wiki_summary,
    "wiki rag": wiki_rag,
    "wiki qa": wiki_qa,
}
PROSE_SHARES = {"news summary": 2.0, "news questions": 1.0, "news writing": 1.0, "wiki summary": 1.5, "wiki rag": 2.0,
                "wiki qa": 1.0}  # fmt: skip
