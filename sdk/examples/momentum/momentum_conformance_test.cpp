// The example plugin passes the conformance kit.
#include <fusebox/testing/conformance.h>

FUSEBOX_CONFORMANCE_TESTS(Momentum, MOMENTUM_PLUGIN_PATH, "lr=0.05", "momentum=0.8");
