"""Keys of recipes across bmm's changed defaults: a key names the merge a recipe makes today, and a
recipe that states the old value finds what was keyed before the default changed."""

from __future__ import annotations

from mergekit_bmm.recipes.changed_defaults import keyed_recipe, relies_on_changed_default


def bmm(**parameters) -> dict:
    return {"merge_method": "bmm", "base_model": "/m/base", "models": [], "parameters": parameters}


def test_a_recipe_that_leaves_gram_sharing_out_is_keyed_as_today_s_default():
    assert keyed_recipe(bmm(gram="data_free")) == keyed_recipe(bmm(gram="data_free", gram_sharing="input"))
    assert keyed_recipe(bmm()) == keyed_recipe(bmm(gram_sharing="input"))  # no gram: data-free
    assert keyed_recipe(bmm(gram="mix")) != keyed_recipe(bmm(gram="mix", gram_sharing="weight"))
    assert relies_on_changed_default(bmm(gram="mix"))
    assert not relies_on_changed_default(bmm(gram="mix", gram_sharing="weight"))


def test_stating_the_old_value_gives_the_key_the_old_default_gave():
    earlier = bmm(gram="data_free", **{"lambda": 0.1})  # as keyed before the default changed
    assert keyed_recipe(bmm(gram="data_free", gram_sharing="weight", **{"lambda": 0.1})) == earlier


def test_recipes_the_rule_does_not_touch_keep_their_keys():
    activations = bmm(gram="activations", stats="/s")
    assert keyed_recipe(activations) == activations and not relies_on_changed_default(activations)
    for rule in ("weight", "input"):  # one Gram per input either way: the same merge, the same key
        assert keyed_recipe(bmm(gram="activations", stats="/s", gram_sharing=rule)) == activations
    ties = {"merge_method": "ties", "models": [], "parameters": {"density": 0.5}}
    assert keyed_recipe(ties) == ties and not relies_on_changed_default(ties)
    original = bmm(gram="data_free")
    keyed_recipe(original)
    assert original == bmm(gram="data_free")  # the recipe itself is left as written
