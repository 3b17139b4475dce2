"""The seeded word-problem generator behind `load_problems("synthetic")`: six GSM-style templates whose worked
solutions' `<<a*b=c>>` annotations are the computation, padded by number-free scene sentences to vary lengths."""

from __future__ import annotations

import random

_PEOPLE = (("Maya", "she", "her"), ("Liam", "he", "his"), ("Aisha", "she", "her"), ("Noah", "he", "his"),
           ("Sofia", "she", "her"), ("Kenji", "he", "his"), ("Priya", "she", "her"), ("Mateo", "he", "his"),
           ("Chloe", "she", "her"), ("Omar", "he", "his"), ("Elena", "she", "her"), ("Tariq", "he", "his"),
           ("Grace", "she", "her"), ("Jonas", "he", "his"), ("Lucia", "she", "her"), ("Daniel", "he", "his"))
_SHOP_ITEMS = (("notebooks", 2, 6), ("pens", 1, 3), ("boxes of crayons", 3, 8), ("sandwiches", 4, 9),
               ("movie tickets", 6, 14), ("apples", 1, 2), ("cups of coffee", 2, 5), ("bags of rice", 5, 12),
               ("t-shirts", 8, 20), ("plant pots", 3, 10))
_SHARE_THINGS = ("stickers", "marbles", "cookies", "baseball cards", "seashells", "crayons", "strawberries")
_MACHINES = (("bakery oven", "bakes", "loaves of bread"), ("printer", "prints", "pages"),
             ("toy factory machine", "builds", "toy cars"), ("juice press", "fills", "bottles"),
             ("sewing machine", "stitches", "patches"))
_PURCHASES = ("bike helmet", "board game", "pair of shoes", "video game", "backpack", "telescope")
_JOBS = ("babysitting", "walking dogs", "mowing lawns", "washing cars", "tutoring")
_SCENES = ("It is an ordinary weekday in a small town.",
           "Everyone involved wants to know the exact number, so they write everything down carefully.",
           "The question came up during a family dinner, and nobody could agree on the answer at first.",
           "It has been a busy week, and there are many things to keep track of.",
           "A teacher later uses this story as a warm-up exercise for the whole class.",
           "Nothing else changes during this time, and nobody makes any mistakes with the counting.")


class _Solution(list[str]):
    """A GSM8K-style worked solution, one `<<expr=value>>` line per `step` (at the `{}` of its `template`)."""

    def step(self, expr: str, value: int, template: str) -> int:
        self.append(template.format(f"{expr} = <<{expr.replace(' ', '')}={value}>>{value}"))
        return value


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _shopping(rng: random.Random, sol: _Solution) -> tuple[str, int]:
    name, subj, _ = rng.choice(_PEOPLE)
    items = rng.sample(_SHOP_ITEMS, rng.randint(1, 4))
    bought, costs = [], []
    for plural, lo, hi in items:
        qty, price = rng.randint(2, 9), rng.randint(lo, hi)
        bought.append(f"{qty} {plural} at ${price} each")
        costs.append(sol.step(f"{qty} * {price}", qty * price, f"The {plural} cost {{}} dollars."))
    total = costs[0]
    if len(costs) > 1:
        total = sol.step(" + ".join(map(str, costs)), sum(costs), "Altogether that is {} dollars.")
    listed = " and ".join(bought) if len(bought) <= 2 else ", ".join(bought[:-1]) + ", and " + bought[-1]
    text = f"{name} goes to the store and buys {listed}."
    if rng.random() < 0.5:
        bill = next(b for b in (10, 20, 50, 100, 200, 500) if b >= total)
        change = sol.step(f"{bill} - {total}", bill - total, "The change is {} dollars.")
        return f"{text} {subj.capitalize()} pays with a ${bill} bill. How much change does {subj} get back?", change
    return f"{text} How much money does {subj} spend in total?", total


def _sharing(rng: random.Random, sol: _Solution) -> tuple[str, int]:
    name, subj, poss = rng.choice(_PEOPLE)
    things = rng.choice(_SHARE_THINGS)
    friends, each = rng.randint(2, 6), rng.randint(2, 12)
    shared = friends * each
    style = rng.randint(0, 2)
    if style == 0:
        text = f"{name} has {shared} {things}. {subj.capitalize()} shares them equally among {friends} friends."
    else:
        keep = rng.randint(1, 15)
        if style == 1:
            have = shared + keep
            text = f"{name} has {have} {things}."
        else:
            packs = rng.randint(2, 6)
            size = -(-(shared + keep) // packs)
            have = sol.step(f"{packs} * {size}", packs * size, f"{name} has {{}} {things}.")
            keep = have - shared
            text = f"{name} buys {packs} packs of {things} with {size} in each pack."
        text += (f" {subj.capitalize()} keeps {keep} for {poss} little sister and shares the rest equally among "
                 f"{friends} friends.")
        sol.step(f"{have} - {keep}", shared, "That leaves {} to share.")
    each = sol.step(f"{shared} / {friends}", each, "Each friend gets {}.")
    return f"{text} How many {things} does each friend get?", each


def _rates(rng: random.Random, sol: _Solution) -> tuple[str, int]:
    machine, verb, things = rng.choice(_MACHINES)
    per_minute = rng.random() < 0.3
    rate = rng.randint(2, 6) if per_minute else rng.randint(5, 40)
    hours = rng.randint(2, 8)
    text = f"A {machine} {verb} {rate} {things} every {'minute' if per_minute else 'hour'}."
    if per_minute:
        rate = sol.step(f"{rate} * 60", rate * 60, f"In an hour it makes {{}} {things}.")
    days = rng.randint(2, 7) if rng.random() < 0.7 else 1
    if days == 1:
        total = sol.step(f"{rate} * {hours}", rate * hours, f"It makes {{}} {things}.")
        return f"{text} How many {things} does it make in {hours} hours?", total
    text += f" It runs for {hours} hours every day."
    good = ""
    daily = sol.step(f"{rate} * {hours}", rate * hours, f"Each day it makes {{}} {things}.")
    if rng.random() < 0.5:
        broken = rng.randint(1, max(1, daily // 4))
        text += f" Each day, {broken} of the {things} come out damaged and are thrown away."
        good = "good "
        daily = sol.step(f"{daily} - {broken}", daily - broken, f"Each day {{}} good {things} are left.")
    total = sol.step(f"{daily} * {days}", daily * days, f"In {days} days that is {{}} {things}.")
    if rng.random() < 0.4:
        price = rng.randint(1, 5)
        money = sol.step(f"{total} * {price}", total * price, "They are sold for {} dollars.")
        return (f"{text} Every {good}one is sold for ${price}. How many dollars does the owner earn in {days} "
                "days?", money)
    return f"{text} How many {good}{things} does it make in {days} days?", total


def _ages(rng: random.Random, sol: _Solution) -> tuple[str, int]:
    people = [p[0] for p in rng.sample(_PEOPLE, 4)]
    ages = [rng.randint(3, 15)]
    text = [f"{people[0]} is {ages[0]} years old."]
    for k in range(1, rng.randint(2, 4)):
        prev, who, ref = ages[-1], people[k], people[k - 1]
        kinds = ("older", "twice", "younger") if prev < 40 else ("older", "younger")
        kind = rng.choice(kinds if prev >= 4 else kinds[:2])
        if kind == "older":
            d = rng.randint(2, 9)
            expr, age, relation = f"{prev} + {d}", prev + d, f"{d} years older than"
        elif kind == "twice":
            expr, age, relation = f"2 * {prev}", 2 * prev, "twice as old as"
        else:
            d = rng.randint(1, prev - 3)
            expr, age, relation = f"{prev} - {d}", prev - d, f"{d} years younger than"
        ages.append(sol.step(expr, age, f"{who} is {{}} years old."))
        text.append(f"{who} is {relation} {ref}.")
    last = people[len(ages) - 1]
    ask = rng.randint(0, 2)
    if ask == 0:
        return " ".join(text) + f" How old is {last}?", ages[-1]
    if ask == 1:
        later = rng.randint(2, 10)
        age = sol.step(f"{ages[-1]} + {later}", ages[-1] + later, f"In {later} years {last} will be {{}}.")
        return " ".join(text) + f" How old will {last} be in {later} years?", age
    total = sol.step(" + ".join(map(str, ages)), sum(ages), "Together they are {} years old.")
    ask_sum = (f"What is the sum of all {('three', 'four')[len(ages) - 3]} ages?" if len(ages) > 2
               else f"What is the sum of {people[0]}'s and {people[1]}'s ages?")
    return f"{' '.join(text)} {ask_sum}", total


def _savings(rng: random.Random, sol: _Solution) -> tuple[str, int]:
    name, subj, poss = rng.choice(_PEOPLE)
    weekly, weeks = rng.randint(3, 25), rng.randint(2, 12)
    saved = sol.step(f"{weekly} * {weeks}", weekly * weeks, f"{name} saves {{}} dollars.")
    if rng.random() < 0.25:
        return f"{name} saves ${weekly} every week. How much money does {subj} save in {weeks} weeks?", saved
    start = rng.randint(5, 60)
    text = f"{name} has ${start} in {poss} piggy bank."
    text += f" {subj.capitalize()} saves ${weekly} every week for {weeks} weeks."
    money = sol.step(f"{start} + {saved}", start + saved, "Then there is {} dollars in the bank.")
    if rng.random() < 0.6:
        item, price = rng.choice(_PURCHASES), rng.randint(1, money)
        text += f" Then {subj} buys a {item} for ${price}."
        money = sol.step(f"{money} - {price}", money - price, "After the purchase {} dollars are left.")
    if rng.random() < 0.5:
        job, earned = rng.choice(_JOBS), rng.randint(5, 40)
        text += f" After that, {subj} earns ${earned} {job}."
        money = sol.step(f"{money} + {earned}", money + earned, "Now there is {} dollars.")
    if rng.random() < 0.4 and money % 2 == 0:
        text += f" Finally, {subj} gives half of {poss} money to {poss} brother."
        money = sol.step(f"{money} / 2", money // 2, "Half leaves {} dollars.")
    return f"{text} How much money does {name} have now?", money


def _travel(rng: random.Random, sol: _Solution) -> tuple[str, int]:
    name, subj, _ = rng.choice(_PEOPLE)
    v1, h1 = rng.randint(20, 70), rng.randint(1, 4)
    d1 = sol.step(f"{v1} * {h1}", v1 * h1, "The first part is {} miles.")
    text = f"{name} drives at {v1} miles per hour for {_plural(h1, 'hour')}"
    if rng.random() < 0.4:
        return f"{text}. How many miles does {subj} drive?", d1
    v2, h2 = rng.randint(20, 70), rng.randint(1, 4)
    d2 = sol.step(f"{v2} * {h2}", v2 * h2, "The second part is {} miles.")
    text += f", stops for lunch, and then drives at {v2} miles per hour for {_plural(h2, 'more hour')}."
    total = sol.step(f"{d1} + {d2}", d1 + d2, "In total that is {} miles.")
    if rng.random() < 0.5:
        trip = total + rng.randint(5, 120)
        left = sol.step(f"{trip} - {total}", trip - total, "{} miles are left.")
        return f"{text} The whole trip is {trip} miles long. How many miles does {subj} still have to drive?", left
    return f"{text} How many miles does {subj} drive in total?", total


_TEMPLATES = (_shopping, _sharing, _rates, _ages, _savings, _travel)


def word_problem(seed: int, i: int) -> tuple[str, str, int]:
    """Problem `i` of the stream `seed`: (question, worked solution ending in `#### <answer>`, answer). It depends
    only on (seed, i), so a longer stream extends a shorter one without changing its start."""
    rng = random.Random(f"cbkit-synthetic/{seed}/{i}")
    sol = _Solution()
    question, answer = rng.choice(_TEMPLATES)(rng, sol)
    if answer < 0:  # a template bug, not a user error: fail where it happens
        raise AssertionError(f"synthetic problem {i} (seed {seed}) has negative answer {answer}")
    scenes = rng.sample(_SCENES, rng.choice((0, 0, 1, 2)))
    return " ".join([*scenes, question]), "\n".join([*sol, f"#### {answer}"]), answer
