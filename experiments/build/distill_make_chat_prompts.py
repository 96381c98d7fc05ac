#!/usr/bin/env python
"""Write the bundled chat prompt sets of `treespec distill` (templates x topics, seeded).

    python experiments/build/distill_make_chat_prompts.py

writes `treespec/distill/prompts/chat_train.jsonl` (3,000 instructions) and
`chat_heldout.jsonl` (64). Each line is {"prompt": ..., "category": ...}. Categories: writing,
explanation, coding, math, lists, rewriting, Q&A, advice, comparison, classification. Every
slot list (topics, concepts, tasks, countries, ...) is split once: the held-out prompts are
built only from entries the training prompts never use, so the benchmark set shares templates
with training but no subject matter (math prompts differ in their numbers; no prompt is in both).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "treespec" / "distill" / "prompts"

SLOTS = {
    "topic": """the ocean; volcanoes; autumn leaves; a rainy morning; city traffic; the first snow;
        a lighthouse; friendship; a lost key; the night sky; coffee; a mountain village; honeybees;
        a thunderstorm; old books; a train journey; the desert; a garden in spring; moving to a new city;
        a lazy Sunday; the moon; a street market; an abandoned house; learning to swim; a birthday party;
        the last day of school; a robot that learns to paint; a cat who thinks it is a dog;
        a time traveller; a river; glaciers; a bakery at dawn; a chess tournament; the northern lights;
        a village festival; a broken umbrella; a long-distance phone call; a family recipe;
        the smell of rain; a marathon; a quiet library; a kite; a shipwreck; a music box; a summer camp;
        a power outage; a hot air balloon; bicycles; an old photograph; a snowman; fireflies; a treehouse;
        a dragon who is afraid of fire; space travel; a haunted lighthouse; the first day at a new job;
        a forest at night; a jazz club; a paper boat""",
    "concept": """gravity; inflation; photosynthesis; machine learning; compound interest; the water cycle;
        plate tectonics; vaccines; blockchain; the greenhouse effect; supply and demand; evolution;
        black holes; the immune system; electricity; the internet; DNA; climate change; democracy;
        recursion; encryption; the stock market; nuclear fusion; antibiotics; the theory of relativity;
        sleep; memory; rainbows; tides; earthquakes; the placebo effect; cloud computing; opportunity cost;
        natural selection; magnetism; sound waves; the Doppler effect; GPS; solar panels; batteries;
        neural networks; probability; the speed of light; entropy; carbon dating; interest rates;
        the French Revolution; the printing press; the Renaissance; photosynthesis in the ocean;
        a hash table; big-O notation; version control; compilers; operating systems; virtual memory""",
    "task": """reverses a string; checks whether a number is prime; returns the n-th Fibonacci number;
        counts the vowels in a string; removes duplicates from a list while keeping order;
        finds the largest element of a list; merges two sorted lists;
        checks whether a string is a palindrome; computes the factorial of a number;
        converts Celsius to Fahrenheit; flattens a nested list; counts word frequencies in a text;
        returns the second largest number in a list; validates an email address with a regular expression;
        reads a CSV file and sums a column; implements binary search; sorts a list of dictionaries by a key;
        computes the greatest common divisor; transposes a matrix; checks whether two strings are anagrams;
        generates all permutations of a list; rotates a list by k positions;
        finds the longest word in a sentence; converts a Roman numeral to an integer;
        capitalizes the first letter of each word; computes the average of a list of numbers;
        checks whether brackets in a string are balanced; chunks a list into pieces of size n;
        returns the intersection of two lists; computes the running sum of a list""",
    "lang": """Python; JavaScript; Rust; Go; C; Java; TypeScript; Ruby""",
    "country": """France; Japan; Brazil; Canada; Egypt; India; Kenya; Australia; Mexico; Norway; Italy;
        Argentina; Vietnam; Germany; Peru; Spain; Thailand; Morocco; Sweden; Chile; Greece; Turkey; Poland;
        Nigeria; Portugal; Ireland; Indonesia; South Korea; New Zealand; Iceland""",
    "activity": """learning a new language; running a first marathon; saving money;
        cooking for a large group; starting a vegetable garden; sleeping better; public speaking;
        working from home; studying for exams; travelling on a budget; keeping houseplants alive;
        writing a resume; learning to play the guitar; staying focused; making new friends in a new city;
        reducing screen time; hiking safely; taking better photos with a phone; organizing a small wedding;
        training a puppy; learning to code; preparing for a job interview; reducing food waste;
        running a productive meeting; reading more books""",
    "pair": """cats and dogs; tea and coffee; trains and planes; renting and buying a home;
        Python and JavaScript; books and films; summer and winter; cities and the countryside;
        electric cars and petrol cars; SQL and NoSQL databases; running and swimming;
        paper books and e-readers; email and instant messaging; solar and wind power;
        working alone and working in a team; TCP and UDP; lists and tuples in Python; stocks and bonds;
        classical and jazz music; baking and frying""",
    "sentence": """the meeting got moved to tomorrow cause the boss is sick;
        we gonna need more chairs for the party; the report is late because nobody did their part;
        i think the new phone is kinda overpriced; the food was ok but the service was super slow;
        can u send me the files asap; the kids was playing outside all day long;
        this software crash every time I open it; he dont like when people is late;
        our team have finished the project ahead of schedule; the weather were nice so we goes to the beach;
        she have three cats and a dog; the price of apples have gone up again;
        they was not happy with the results; i has been waiting for an hour;
        the museum are closed on mondays""",
    "review": """The battery lasts all day and the screen is gorgeous.;
        It broke after two days and support never replied.;
        Decent sound for the price, though the bass is weak.;
        The hotel room was spotless and the staff were lovely.;
        Worst pizza I have had in years, cold and soggy.;
        The book started slowly but the ending was brilliant.;
        Shipping took a month and the box was damaged.; Exactly as described, would buy again.;
        The film was far too long and the plot made no sense.; Comfortable shoes, I wear them every day.;
        The app keeps logging me out, very frustrating.; Friendly teacher and a well organised course.""",
    "category": """fruits that are red; countries in South America; planets in the solar system;
        programming languages; musical instruments with strings; animals that live in the Arctic;
        famous painters; board games; vegetables that grow underground; Olympic sports; types of clouds;
        kitchen tools; rivers in Europe; birds that cannot fly; renewable energy sources; famous scientists;
        dog breeds; cheeses from France""",
    "goal": """get better at mental math; remember people's names; keep a journal every day;
        wake up earlier; write cleaner code; negotiate a higher salary; learn to touch type;
        make my small apartment feel bigger; stop procrastinating; become a better listener;
        plan a week of healthy meals; prepare for a long flight; improve my handwriting; learn to draw;
        drink more water; be more productive in the morning""",
    "book": """Pride and Prejudice; Don Quixote; The Odyssey; Frankenstein; War and Peace;
        One Hundred Years of Solitude; The Great Gatsby; Moby-Dick; Crime and Punishment; The Little Prince;
        Jane Eyre; The Hobbit; To Kill a Mockingbird; Hamlet; The Divine Comedy; Madame Bovary""",
}

TEMPLATES = {
    "writing": [
        "Write a short poem about {topic}.",
        "Write a haiku about {topic}.",
        "Write a very short story about {topic}.",
        "Write the opening paragraph of a novel about {topic}.",
        "Write a limerick about {topic}.",
        "Describe {topic} in three vivid sentences.",
        "Write a friendly email inviting a friend to talk about {topic}.",
        "Write a short speech for a school assembly about {topic}.",
    ],
    "explanation": [
        "Explain {concept} to a ten-year-old.",
        "Explain how {concept} works in simple terms.",
        "What is {concept}?",
        "Why does {concept} matter? Answer in a short paragraph.",
        "Give a one-paragraph summary of {concept}.",
        "What is a common misconception about {concept}?",
        "Explain {concept} using an everyday analogy.",
    ],
    "coding": [
        "Write a {lang} function that {task}.",
        "In {lang}, how would you write code that {task}?",
        "Write a {lang} function that {task}, and explain how it works.",
        "Write a unit test for a {lang} function that {task}.",
        "What is the time complexity of a function that {task}? Explain briefly.",
    ],
    "math": [
        "What is {a} times {b}?",
        "What is {a} plus {b}?",
        "Solve for x: {c}x + {a} = {b}.",
        "What is {c}% of {b}?",
        "Is {a} a prime number? Explain.",
        "Convert {c} degrees Celsius to Fahrenheit.",
        "A train travels {b} km in {c} hours. What is its average speed?",
        "If a shirt costs ${b} and is discounted by {c}%, what is the new price?",
        "What is the square root of {sq}?",
        "Round {a}.{c} to the nearest whole number.",
    ],
    "lists": [
        "List five facts about {topic}.",
        "Give me three tips for {activity}.",
        "Name five {category}.",
        "List the main steps of {activity}.",
        "List three interesting facts about {country}.",
        "Give me a checklist for {activity}.",
    ],
    "rewriting": [
        'Rewrite this sentence to sound more formal: "{sentence}"',
        'Correct the grammar of this sentence: "{sentence}"',
        'Rewrite this sentence so that a child can understand it: "{sentence}"',
        'Translate this sentence into French: "{sentence}"',
        'Make this sentence more polite: "{sentence}"',
    ],
    "qa": [
        "What is the capital of {country}?",
        "What language is spoken in {country}?",
        "Who wrote {book}?",
        "What is {book} about?",
        "What is the population of {country}, roughly?",
        "What is {country} famous for?",
        "When was {book} written?",
    ],
    "advice": [
        "How can I {goal}?",
        "What are some good ways to {goal}?",
        "I want to {goal}. Where should I start?",
        "What mistakes should I avoid when {activity}?",
    ],
    "comparison": [
        "Compare {pair}.",
        "What are the main differences between {pair}?",
        "Which is better for a beginner: {pair}? Explain.",
        "Give the pros and cons of {pair}.",
    ],
    "classification": [
        'Is this review positive or negative? "{review}"',
        'Classify the sentiment of this review as positive, negative or mixed: "{review}"',
        'Summarize this review in five words: "{review}"',
    ],
}


def split_slots(rng: random.Random, heldout_share: float) -> tuple[dict, dict]:
    """Each slot list split into (train, held-out) entries, held-out about `heldout_share`."""
    train, held = {}, {}
    for name, text in SLOTS.items():
        items = [" ".join(s.split()) for s in text.split(";") if s.strip()]
        rng.shuffle(items)
        k = max(1, round(len(items) * heldout_share))
        held[name], train[name] = items[:k], items[k:]
    return train, held


def fill(template: str, slots: dict, rng: random.Random) -> str:
    values = {name: rng.choice(items) for name, items in slots.items()}
    values.update(
        a=rng.randint(2, 99), b=rng.randint(10, 999), c=rng.randint(2, 30), sq=rng.randint(2, 30) ** 2
    )
    return template.format(**values)


def generate(n: int, slots: dict, rng: random.Random, exclude: set[str] = frozenset()) -> list[dict]:
    """`n` distinct prompts not in `exclude`, categories taking turns (a category that yields
    nothing new in 1,000 draws drops out), templates and slot values drawn at random."""
    out, seen = [], set(exclude)
    categories = list(TEMPLATES)
    turn = 0
    while len(out) < n:
        category = categories[turn % len(categories)]
        for _ in range(1000):
            prompt = fill(rng.choice(TEMPLATES[category]), slots, rng)
            if prompt not in seen:
                seen.add(prompt)
                out.append({"prompt": prompt, "category": category})
                turn += 1
                break
        else:
            categories.remove(category)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", type=int, default=3000)
    ap.add_argument("--heldout", type=int, default=64)
    ap.add_argument("--seed", type=int, default=26)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    train_slots, held_slots = split_slots(rng, heldout_share=0.15)
    OUT.mkdir(parents=True, exist_ok=True)
    train = generate(args.train, train_slots, rng)
    held = generate(args.heldout, held_slots, rng, exclude={r["prompt"] for r in train})
    for name, rows in (("chat_train", train), ("chat_heldout", held)):
        (OUT / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"wrote {len(rows)} prompts to {OUT / name}.jsonl")


if __name__ == "__main__":
    main()
