// What a run writes and prints: the metrics files (each record written once, appended after the
// first write; a resumed run's history leaves out a record cut short by a kill; only unwritten
// records stay in memory) and the progress lines.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <fstream>
#include <sstream>
#include <string>

#include "output.h"
#include "trainer_test_util.h"

using fusebox::trainer::MetricsColumns;
using fusebox::trainer::MetricsFiles;
using fusebox::trainer::MetricsHistory;
using fusebox::trainer::Progress;
using fusebox::trainer::read_metrics_history;
using fusebox::trainer::StepMetrics;
using namespace fusebox::trainer::testing;

namespace {

StepMetrics record(int64_t step) {
  StepMetrics m;
  m.step = step;
  m.loss = 1.0 / static_cast<double>(step);
  m.lrs = {0.1};
  m.effective_lrs = {0.1};
  m.peak_phase = "backward";
  return m;
}

ino_t inode(const std::string& file) {
  struct stat st {};
  EXPECT_EQ(::stat(file.c_str(), &st), 0) << file;
  return st.st_ino;
}

}  // namespace

TEST(MetricsFiles, TheFirstWriteReplacesOldFilesAndLaterOnesAppendOnlyNewRecords) {
  TempDir tmp;
  const std::string jsonl = tmp.file("metrics.jsonl"), csv = tmp.file("metrics.csv");
  tmp.write("metrics.jsonl",
            "{\"step\":1,\"loss\":99}\n{\"step\":2,\"loss\":99}\n");  // an earlier run's
  MetricsFiles files(tmp.str(), MetricsColumns{});
  files.add(record(1));
  files.add(record(2));
  EXPECT_GT(files.pending_bytes(), 0u);
  files.snapshot();
  EXPECT_EQ(files.pending_bytes(), 0u);  // written records are not kept
  const std::string first = read_text(jsonl), first_csv = read_text(csv);
  EXPECT_EQ(first.find("99"), std::string::npos) << "the earlier run's records were replaced";
  EXPECT_EQ(count_lines(first), 2);
  EXPECT_EQ(count_lines(first_csv), 3);  // header and two rows
  const ino_t jsonl_inode = inode(jsonl), csv_inode = inode(csv);

  files.add(record(3));
  files.snapshot();
  files.snapshot();  // nothing new: no second copy
  files.add(record(4));
  files.commit(fusebox::trainer::RunSummary{});
  const std::string last = read_text(jsonl), last_csv = read_text(csv);
  // Appended in place: the same files, the earlier bytes untouched, one line per new step.
  EXPECT_EQ(inode(jsonl), jsonl_inode);
  EXPECT_EQ(inode(csv), csv_inode);
  ASSERT_EQ(last.compare(0, first.size(), first), 0);
  ASSERT_EQ(last_csv.compare(0, first_csv.size(), first_csv), 0);
  EXPECT_EQ(count_lines(last), 4);
  EXPECT_EQ(count_lines(last_csv), 5);
  EXPECT_EQ(last.substr(first.size()).rfind("{\"step\":3,", 0), 0u) << last;
  EXPECT_NE(last.find("{\"step\":4,"), std::string::npos) << last;
  EXPECT_TRUE(std::filesystem::exists(tmp.file("summary.json")));
}

// A resumed run starts from the records up to its checkpoint: later ones (written by the killed
// run after that checkpoint) and a last line without its newline (a write cut short) are left out.
TEST(MetricsFiles, AResumedRunKeepsWholeRecordsUpToItsCheckpoint) {
  TempDir tmp;
  {
    MetricsFiles files(tmp.str(), MetricsColumns{});
    for (int64_t s = 1; s <= 5; ++s) files.add(record(s));
    files.snapshot();
  }
  // Step 6's record cut short in both files.
  std::ofstream(tmp.file("metrics.jsonl"), std::ios::app) << "{\"step\":6,\"lo";
  std::ofstream(tmp.file("metrics.csv"), std::ios::app) << "6,0.1";

  const MetricsHistory all = read_metrics_history(tmp.str(), 5, MetricsColumns{});
  EXPECT_EQ(count_lines(all.jsonl), 5) << all.jsonl;
  EXPECT_EQ(all.jsonl.find("\"step\":6"), std::string::npos) << all.jsonl;
  EXPECT_EQ(count_lines(all.csv_rows), 5) << all.csv_rows;
  EXPECT_FALSE(all.not_the_checkpoints_run);
  // A checkpoint of step 6 with step 6 cut short is not this history: nothing is carried.
  const MetricsHistory six = read_metrics_history(tmp.str(), 6, MetricsColumns{});
  EXPECT_TRUE(six.jsonl.empty());
  EXPECT_TRUE(six.not_the_checkpoints_run);
  // The checkpoint's own last record must close the history: another run's step 5 does not.
  std::string fifth;
  {
    std::istringstream in(read_text(tmp.file("metrics.jsonl")));
    for (int i = 0; i < 5; ++i) std::getline(in, fifth);
  }
  EXPECT_FALSE(
      read_metrics_history(tmp.str(), 5, MetricsColumns{}, &fifth).not_the_checkpoints_run);
  const std::string other = fifth + " ";
  EXPECT_TRUE(read_metrics_history(tmp.str(), 5, MetricsColumns{}, &other).not_the_checkpoints_run);

  const MetricsHistory three = read_metrics_history(tmp.str(), 3, MetricsColumns{});
  EXPECT_EQ(count_lines(three.jsonl), 3);
  EXPECT_EQ(count_lines(three.csv_rows), 3);
  EXPECT_FALSE(three.csv_columns_differ);
  const MetricsHistory two_groups = read_metrics_history(tmp.str(), 3, MetricsColumns{2});
  EXPECT_TRUE(two_groups.csv_rows.empty()) << "other columns";
  EXPECT_TRUE(two_groups.csv_columns_differ);  // the trainer warns that the rows are left out
  EXPECT_TRUE(read_metrics_history(tmp.str(), 3, MetricsColumns{1, /*loss_scale=*/true})
                  .csv_columns_differ);
  EXPECT_FALSE(
      read_metrics_history(tmp.file("elsewhere"), 3, MetricsColumns{2}).csv_columns_differ);

  // The resumed run's files: steps 1..3, then its own 4 and 5; nothing of the killed run's after.
  MetricsFiles resumed(tmp.str(), MetricsColumns{}, three);
  resumed.add(record(4));
  resumed.add(record(5));
  resumed.snapshot();
  const std::string text = read_text(tmp.file("metrics.jsonl"));
  EXPECT_EQ(count_lines(text), 5) << text;
  EXPECT_EQ(text.find("\"step\":6"), std::string::npos) << text;
  EXPECT_EQ(read_metrics_history(tmp.str(), 5, MetricsColumns{}).jsonl, text);
}

// A resumed run's rate and ETA count only the steps it trained: 500 steps in 1 s after resuming at
// step 1000 is 500 it/s with 1 s to go (not 1500 it/s); its first line is its first step.
// --eval-every: an eval_loss key on the records that have one, an eval_loss column (empty between
// evaluations), the last one in the summary; a history with other columns is not carried over.
TEST(MetricsFiles, EvaluationsHaveAKeyAColumnAndTheSummarysLastValue) {
  TempDir tmp;
  MetricsColumns columns;
  columns.eval_loss = true;
  MetricsFiles files(tmp.str(), columns);
  files.add(record(1));
  StepMetrics evaluated = record(2);
  evaluated.eval_loss = 0.25;
  files.add(evaluated);
  fusebox::trainer::RunSummary summary;
  summary.eval_loss = 0.25;
  files.commit(summary);
  const std::string jsonl = read_text(tmp.file("metrics.jsonl"));
  const std::string csv = read_text(tmp.file("metrics.csv"));
  EXPECT_LT(jsonl.find("{\"step\":2,"), jsonl.find("eval_loss")) << jsonl;
  EXPECT_NE(jsonl.find(",\"eval_loss\":0.25}\n"), std::string::npos) << jsonl;
  EXPECT_EQ(jsonl.find("eval_loss"), jsonl.rfind("eval_loss")) << "only step 2 has one: " << jsonl;
  EXPECT_NE(csv.find(",peak_phase,eval_loss\n"), std::string::npos) << csv;
  EXPECT_NE(csv.find(",backward,\n"), std::string::npos) << "step 1: empty" << csv;
  EXPECT_NE(csv.find(",backward,0.25\n"), std::string::npos) << csv;
  EXPECT_NE(read_text(tmp.file("summary.json")).find(",\"eval_loss\":0.25}"), std::string::npos);
  EXPECT_FALSE(read_metrics_history(tmp.str(), 2, columns).csv_columns_differ);
  EXPECT_TRUE(read_metrics_history(tmp.str(), 2, MetricsColumns{}).csv_columns_differ);
}

TEST(Progress, ARateCountsOnlyThisInvocationsSteps) {
  std::ostringstream out;
  Progress p(out, /*terminal=*/false, 2000, 500, "", /*first_step=*/1000);
  StepMetrics m = record(1001);
  p.update(m, 0.002);
  EXPECT_NE(out.str().find("step 1001/2000"), std::string::npos) << out.str();
  m = record(1500);
  p.update(m, 1.0);
  EXPECT_NE(out.str().find("step 1500/2000"), std::string::npos) << out.str();
  EXPECT_NE(out.str().find("500.00 it/s"), std::string::npos) << out.str();
  EXPECT_NE(out.str().find("ETA 0:01"), std::string::npos) << out.str();
}
