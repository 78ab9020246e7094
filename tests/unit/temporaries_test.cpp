// Temporaries of files written whole or not at all (engine/files/temporaries.hpp):
// renamed into place on commit, removed when their writer gives up, and removed by
// remove_temporaries() (what a signal that ends a command calls) while they exist.
#include "engine/files/temporaries.hpp"
#include "support/train_fixture.hpp"

#include <boost/filesystem.hpp>
#include <gtest/gtest.h>

#include <fstream>
#include <string>

namespace {

namespace fs = boost::filesystem;

std::string content(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST(Temporaries, CommitRenamesAndAWriterThatGivesUpLeavesTheOldFile) {
  const std::string dir = loom::testing::scratch_dir("temporaries");
  const std::string path = dir + "/out.json";
  std::ofstream(path) << "old";
  {
    loom::files::Temporary tmp(path + ".tmp");
    std::ofstream(tmp.path()) << "half";
  }  // given up: removed, the old file stays
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  EXPECT_EQ(content(path), "old");
  {
    loom::files::Temporary tmp(path + ".tmp");
    std::ofstream(tmp.path()) << "new";
    ASSERT_TRUE(tmp.commit(path));
  }
  EXPECT_EQ(content(path), "new");
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  fs::remove_all(dir);
}

TEST(Temporaries, RemoveTemporariesTakesThoseListedAndNoOther) {
  const std::string dir = loom::testing::scratch_dir("temporaries_signal");
  const std::string kept = dir + "/kept.bin", listed = dir + "/partial.bin.tmp", done = dir + "/done.tmp";
  std::ofstream(kept) << "a finished file";
  loom::files::Temporary committed(done);
  std::ofstream(done) << "x";
  ASSERT_TRUE(committed.commit(dir + "/done"));
  loom::files::add_temporary(listed);
  std::ofstream(listed) << "half";
  loom::files::remove_temporaries();
  EXPECT_FALSE(fs::exists(listed)) << "a listed temporary survived";
  EXPECT_TRUE(fs::exists(kept));
  EXPECT_TRUE(fs::exists(dir + "/done")) << "a committed file is no temporary any more";
  loom::files::forget_temporary(listed);
  std::ofstream(listed) << "again";
  loom::files::remove_temporaries();
  EXPECT_TRUE(fs::exists(listed)) << "a forgotten path was removed";
  fs::remove_all(dir);
}

}  // namespace
