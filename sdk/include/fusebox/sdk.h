// fusebox SDK: everything a plugin includes. Read in this order: error.h, hyperparams.h,
// optimizer.h, plugin.h, update_math.h.
#pragma once

#include "fusebox/error.h"
#include "fusebox/hyperparams.h"
#include "fusebox/optimizer.h"
#include "fusebox/plugin.h"
#include "fusebox/update_math.h"
