// Schema validation: unknown keys, types, ranges and rules each give one line naming plugin+key.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "fusebox/core/hyperparam_validation.h"

using namespace fusebox;

namespace {
Schema make_schema() {
  Schema s;
  s.real("lr", std::monostate{}, "learning rate").above(0).allow_none();
  s.real_pair("betas", {0.9, 0.999}, "betas").at_least(0).below(1);
  s.integer("slice_p", 1, "slice").at_least(1);
  s.flag("nesterov", false, "nesterov");
  s.choice("mode", "fast", {"fast", "slow"}, "mode");
  s.rule("nesterov,lr", [](const HyperParams& h) -> std::string {
    return h.flag("nesterov") && !h.is_set("lr") ? "nesterov needs lr" : "";
  });
  return s;
}
UserArgs cli(std::map<std::string, std::string> kv) {
  UserArgs a;
  for (auto& [k, v] : kv) a[k] = UserArg{std::monostate{}, v, "--optimizer-args"};
  return a;
}
std::string error_of(const UserArgs& a) {
  try {
    validate_hyperparams(make_schema(), "demo", a);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(HyperparamValidation, DefaultsAreFilledIn) {
  HyperParams h = validate_hyperparams(make_schema(), "demo", {});
  EXPECT_FALSE(h.is_set("lr"));
  EXPECT_EQ(h.real_pair("betas").second, 0.999);
  EXPECT_EQ(h.integer("slice_p"), 1);
  EXPECT_EQ(h.text("mode"), "fast");
}

TEST(HyperparamValidation, ParsesCommandLineText) {
  HyperParams h = validate_hyperparams(
      make_schema(), "demo",
      cli({{"lr", "1e-3"}, {"betas", "(0.8, 0.99)"}, {"slice_p", "11"}, {"nesterov", "true"}}));
  EXPECT_DOUBLE_EQ(h.real("lr"), 1e-3);
  EXPECT_DOUBLE_EQ(h.real_pair("betas").first, 0.8);
  EXPECT_EQ(h.integer("slice_p"), 11);
  EXPECT_TRUE(h.flag("nesterov"));
}

TEST(HyperparamValidation, TypedValuesFromTomlWidenIntsToDoubles) {
  UserArgs a;
  a["lr"] = UserArg{int64_t{1}, "", "run.toml:3:1"};
  EXPECT_DOUBLE_EQ(validate_hyperparams(make_schema(), "demo", a).real("lr"), 1.0);
  a["slice_p"] = UserArg{2.5, "", "run.toml:4:1"};
  try {
    validate_hyperparams(make_schema(), "demo", a);
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "run.toml:4:1: demo: hyperparameter 'slice_p': expected integer, got 2.5");
  }
}

TEST(HyperparamValidation, UnknownKeySuggestsNearest) {
  std::string m = error_of(cli({{"beta", "(0.9,0.9)"}}));
  EXPECT_NE(m.find("demo: unknown hyperparameter 'beta' (did you mean 'betas'?)"),
            std::string::npos)
      << m;
}

TEST(HyperparamValidation, WrongTypeOutOfRangeEnumAndRule) {
  EXPECT_NE(error_of(cli({{"lr", "fast"}})).find("'lr': 'fast' is not a number"),
            std::string::npos);
  EXPECT_NE(error_of(cli({{"lr", "-1"}})).find("'lr': -1 is outside (0, inf)"), std::string::npos);
  EXPECT_NE(error_of(cli({{"betas", "(0.9,1.0)"}})).find("each value must be in [0, 1)"),
            std::string::npos);
  EXPECT_NE(error_of(cli({{"slice_p", "0"}})).find("'slice_p'"), std::string::npos);
  EXPECT_NE(error_of(cli({{"mode", "fsat"}})).find("did you mean 'fast'"), std::string::npos);
  EXPECT_NE(error_of(cli({{"nesterov", "true"}})).find("(nesterov,lr): nesterov needs lr"),
            std::string::npos);
  EXPECT_NE(error_of(cli({{"slice_p", "none"}})).find("none is not allowed"), std::string::npos);
}

// An unbounded end is open: inf reaches a plugin (and a parameter) only where a bound admits it.
TEST(HyperparamValidation, InfinityIsRefusedUnlessABoundAdmitsIt) {
  for (const std::string v : {"inf", "1e400", "Infinity"})
    EXPECT_NE(error_of(cli({{"lr", v}})).find("'lr': inf is outside (0, inf)"), std::string::npos)
        << v << ": " << error_of(cli({{"lr", v}}));
  EXPECT_NE(error_of(cli({{"betas", "(-inf,0.5)"}})).find("'betas'"), std::string::npos);
  Schema s;
  s.real("growth", std::numeric_limits<double>::infinity(), "unlimited by default")
      .at_least(1)
      .at_most(std::numeric_limits<double>::infinity());
  s.real("free", 0.0, "no bounds declared");
  EXPECT_TRUE(std::isinf(validate_hyperparams(s, "demo", {}).real("growth")));
  EXPECT_TRUE(std::isinf(validate_hyperparams(s, "demo", cli({{"growth", "inf"}})).real("growth")));
  EXPECT_THROW(validate_hyperparams(s, "demo", cli({{"free", "-inf"}})), Error);
  EXPECT_EQ(validate_hyperparams(s, "demo", cli({{"free", "-1e300"}})).real("free"), -1e300);
}

TEST(HyperparamValidation, RealDeclaresFromANumberNoneOrAValue) {
  Schema s;
  s.real("from_int", 2, "an integer literal is a real");
  s.real("from_double", 0.5, "a double");
  s.real("none", std::monostate{}, "no default").allow_none();
  const Value held = 0.25;
  s.real("from_value", held, "a default held in a Value");
  for (const auto& spec : s.specs()) EXPECT_EQ(spec.type, ParamType::Double) << spec.name;
  HyperParams h = validate_hyperparams(s, "demo", {});
  EXPECT_EQ(h.real("from_int"), 2.0);
  EXPECT_EQ(h.real("from_double"), 0.5);
  EXPECT_FALSE(h.is_set("none"));
  EXPECT_EQ(h.real("from_value"), 0.25);
}

// What a declaration returns may be kept and refined after more keys are declared (the schema's
// storage grows in between): the bound still reaches the declared key.
TEST(HyperparamValidation, AKeptDeclarationStillRefinesItsKeyAfterMoreAreDeclared) {
  Schema s;
  auto lr = s.real("lr", 0.1, "learning rate");
  for (int i = 0; i < 50; ++i) s.real("k" + std::to_string(i), 0.0, "filler");
  lr.above(0).at_most(10);
  EXPECT_EQ(s.find("lr")->lo, 0.0);
  EXPECT_TRUE(s.find("lr")->lo_open);
  UserArgs a;
  a["lr"] = UserArg{std::monostate{}, "0", "--optimizer-args"};
  EXPECT_THROW(validate_hyperparams(s, "demo", a), Error);
  a["lr"].text = "11";
  EXPECT_THROW(validate_hyperparams(s, "demo", a), Error);
}

// A rule that throws (a bug in the plugin) is reported with the plugin and the rule's keys.
TEST(HyperparamValidation, ARuleThatThrowsNamesThePluginAndTheRule) {
  Schema s;
  s.real("lr", 0.1, "learning rate");
  s.rule("lr,beta9", [](const HyperParams& h) -> std::string {
    return h.real("beta9") > 0 ? "" : "bad";  // beta9 was never declared: HyperParams throws
  });
  try {
    validate_hyperparams(s, "demo", {});
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("demo: the plugin's rule over (lr,beta9) threw instead of returning a "
                     "message"),
              std::string::npos)
        << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  }
}

// One that throws a value that is no std::exception is an Error too, not an escape past every
// handler that catches std::exception.
TEST(HyperparamValidation, ARuleThatThrowsANonStandardValueGivesAnError) {
  Schema s;
  s.real("lr", 0.1, "learning rate");
  s.rule("lr", [](const HyperParams&) -> std::string { throw 42; });
  try {
    validate_hyperparams(s, "demo", {});
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("demo: the plugin's rule over (lr) threw something that "
                                         "is not a std::exception"),
              std::string::npos)
        << e.what();
  }
}

// TOML's `slice_p = 2.0` for an integer key says it is a float and how to write it.
TEST(HyperparamValidation, AFloatForAnIntegerSaysSo) {
  UserArgs a;
  a["slice_p"] = UserArg{2.0, "", "run.toml:3:1"};
  const std::string m = error_of(a);
  EXPECT_NE(m.find("expected integer, got 2.0, a float (write it without the decimal point)"),
            std::string::npos)
      << m;
  a["slice_p"] = UserArg{1e20, "", "run.toml:3:1"};
  const std::string big = error_of(a);
  EXPECT_NE(big.find("expected integer, got 1e+20, a float"), std::string::npos) << big;
  EXPECT_EQ(big.find("1e+20.0"), std::string::npos) << big;
}
