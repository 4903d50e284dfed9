"""
make_rows.py -- your task's rows: questions whose answer is one word, asked for in one word.

    python your_task/make_rows.py            # writes your_task/data/train.jsonl and test.jsonl

The task: "What is the capital of Norway? Answer with one word." and "What is the plural of
horse? Answer with one word." SmolLM2-135M-Instruct knows most of these answers but says them in
a sentence ("The capital of Norway is Oslo."); the reward (reward.py) pays for the right word, and
more the fewer words come with it. So GRPO has something to find: the same knowledge, said the way
the question asks.

Each line of train.jsonl and test.jsonl is one JSON object, TRL's dataset format: a "prompt" plus
any columns your reward reads (here "target"). The prompt is a list of chat messages, which the
model's chat template turns into text:

    {"prompt": [{"role": "user", "content": "What is ...? One word."}], "target": "Oslo"}

or plain text, used as it is: {"prompt": "Q: What is ...?\\nA:", "target": "Oslo"}. Train and test
must not share a question: test.jsonl is what a run scores before and after.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Countries whose capital is one plain ASCII word.
CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo",
    "Egypt": "Cairo", "Russia": "Moscow", "Canada": "Ottawa", "Australia": "Canberra",
    "Greece": "Athens", "Poland": "Warsaw", "Norway": "Oslo", "Sweden": "Stockholm",
    "Finland": "Helsinki", "Denmark": "Copenhagen", "Ireland": "Dublin", "Portugal": "Lisbon",
    "Austria": "Vienna", "Hungary": "Budapest", "Belgium": "Brussels",
    "the Netherlands": "Amsterdam", "Switzerland": "Bern", "China": "Beijing",
    "Thailand": "Bangkok", "Vietnam": "Hanoi", "Indonesia": "Jakarta", "the Philippines": "Manila",
    "Peru": "Lima", "Chile": "Santiago", "Venezuela": "Caracas", "Cuba": "Havana",
    "Kenya": "Nairobi", "Nigeria": "Abuja", "Morocco": "Rabat", "Turkey": "Ankara",
    "Iran": "Tehran", "Iraq": "Baghdad", "Syria": "Damascus", "Lebanon": "Beirut",
    "Jordan": "Amman", "Afghanistan": "Kabul", "Pakistan": "Islamabad", "Bangladesh": "Dhaka",
    "Nepal": "Kathmandu", "Romania": "Bucharest", "Bulgaria": "Sofia", "Serbia": "Belgrade",
    "Croatia": "Zagreb", "Iceland": "Reykjavik", "the United Kingdom": "London", "Ghana": "Accra",
    "Senegal": "Dakar", "Uganda": "Kampala", "Zimbabwe": "Harare", "Zambia": "Lusaka",
    "Angola": "Luanda", "Libya": "Tripoli", "Tunisia": "Tunis", "Algeria": "Algiers",
    "Sudan": "Khartoum", "Qatar": "Doha", "Oman": "Muscat", "South Korea": "Seoul",
    "Taiwan": "Taipei", "Jamaica": "Kingston", "Estonia": "Tallinn", "Latvia": "Riga",
    "Lithuania": "Vilnius", "Slovakia": "Bratislava", "Albania": "Tirana", "Georgia": "Tbilisi",
    "Armenia": "Yerevan", "Azerbaijan": "Baku", "Uzbekistan": "Tashkent", "Ecuador": "Quito",
    "Uruguay": "Montevideo", "Nicaragua": "Managua", "Laos": "Vientiane",
}
# Nouns whose plural adds an s.
NOUNS = ("apple river table stone horse cloud chair house book tree car dog cat bird road lake "
         "window door garden flower ship train plane song word friend hand eye shoe coat hat bag "
         "cup plate spoon pen pencil desk lamp clock phone bottle box ring bell boat farm field "
         "hill island forest bridge tower castle street market shop school teacher student doctor "
         "player king queen bread cake egg orange banana lemon carrot onion potato seed leaf rock "
         "star planet moon cloud storm wave shell card game toy ball drum guitar piano").split()


def make_rows() -> list[dict]:
    """One row per question: its chat-message prompt and the one word that answers it."""
    rows = [(f"What is the capital of {country}? Answer with one word.", capital)
            for country, capital in CAPITALS.items()]
    rows += [(f"What is the plural of {noun}? Answer with one word.", noun + "s")
             for noun in dict.fromkeys(NOUNS)]
    return [{"prompt": [{"role": "user", "content": q}], "target": t} for q, t in rows]


def write_jsonl(path: Path, rows: list[dict]):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--out", default=str(HERE / "data"), help="folder to write (your_task/data)")
    p.add_argument("--test", type=int, default=50, help="held-out rows (50)")
    a = p.parse_args(argv)
    rows = make_rows()
    random.Random(0).shuffle(rows)  # WHY: both kinds of question in train and in test
    write_jsonl(Path(a.out) / "test.jsonl", rows[:a.test])
    write_jsonl(Path(a.out) / "train.jsonl", rows[a.test:])
    print(f"{len(rows) - a.test} training rows and {a.test} held out in {a.out}")


if __name__ == "__main__":
    main()
