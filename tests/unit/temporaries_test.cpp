// Temporaries of files written whole or not at all (engine/files/temporaries.hpp):
// renamed into place on commit, removed when their writer gives up, and removed by
// remove_temporaries() (what a signal that ends a command calls) while they exist.
#include "engine/files/temporaries.hpp"
#include "support/train_fixture.hpp"

#include <boost/filesystem.hpp>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

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

// A set renamed together: when a rename fails, the names hold what they held before
// (an earlier file put back, a new one where there was none removed), with no links left.
TEST(Temporaries, ASetRenamedTogetherIsWholeOrAsBefore) {
  const std::string dir = loom::testing::scratch_dir("together");
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string a = dir + "/a.bin", b = dir + "/b.new", c = dir + "/c.idx";
  std::ofstream(a) << "old a";
  fs::create_directories(c + "/sub");  // a non-empty directory: renaming onto it fails
  {
    loom::files::Temporary ta(a + ".tmp"), tb(b + ".tmp"), tc(c + ".tmp");
    for (auto* t : {&ta, &tb, &tc}) std::ofstream(t->path()) << "new";
    const std::string why = loom::files::commit_together({{&ta, a}, {&tb, b}, {&tc, c}});
    EXPECT_NE(why.find("cannot rename " + tc.path() + " to " + c), std::string::npos) << why;
  }
  EXPECT_EQ(content(a), "old a");
  EXPECT_FALSE(fs::exists(b));
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(dir)) left.push_back(e.path().filename().string());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"a.bin", "c.idx"}));
  fs::remove_all(c);
  {
    loom::files::Temporary ta(a + ".tmp"), tc(c + ".tmp");
    for (auto* t : {&ta, &tc}) std::ofstream(t->path()) << "new";
    EXPECT_EQ(loom::files::commit_together({{&ta, a}, {&tc, c}}), "");
  }
  EXPECT_EQ(content(a), "new");
  EXPECT_EQ(content(c), "new");
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 2);
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

TEST(Temporaries, ADirectoryMadeForTemporariesGoesOnlyWhenLeftEmpty) {
  const std::string dir = loom::testing::scratch_dir("temporaries_dir");
  const std::string made = dir + "/made", used = dir + "/used";
  fs::create_directories(made);
  fs::create_directories(used);
  loom::files::add_temporary_directory(made);  // listed before its file, removed after it
  loom::files::add_temporary_directory(used);
  loom::files::add_temporary(made + "/model.tmp");
  std::ofstream(made + "/model.tmp") << "half";
  std::ofstream(used + "/kept") << "a user's file";
  loom::files::remove_temporaries();
  EXPECT_FALSE(fs::exists(made)) << "the directory made for a temporary stayed";
  EXPECT_TRUE(fs::exists(used + "/kept")) << "a directory with other files was removed";
  loom::files::forget_temporary(made + "/model.tmp");
  loom::files::forget_temporary(made);
  loom::files::forget_temporary(used);
  // Parents made for it go too, once their listed child is gone (listed in any order).
  fs::create_directories(made + "/a/b");
  for (const std::string& d : {made, made + "/a/b", made + "/a"}) loom::files::add_temporary_directory(d);
  loom::files::remove_temporaries();
  EXPECT_FALSE(fs::exists(made)) << "a parent made for the temporaries stayed";
  for (const std::string& d : {made, made + "/a/b", made + "/a"}) loom::files::forget_temporary(d);
  fs::create_directories(made);
  loom::files::remove_temporaries();
  EXPECT_TRUE(fs::exists(made)) << "a forgotten directory was removed";
  fs::remove_all(dir);
}

// The check before long work creates nothing that stays and removes nothing there; a
// link to a file not there yet is written through (the link stays).
TEST(Temporaries, TheWriteCheckLeavesWhatIsThereAndLinksStay) {
  const std::string dir = loom::testing::scratch_dir("temporaries_check");
  EXPECT_EQ(loom::files::cannot_write(dir + "/new.json"), "");
  EXPECT_FALSE(fs::exists(dir + "/new.json.tmp")) << "the probe stayed";
  std::ofstream(dir + "/kept.json.tmp") << "an earlier writer's";
  EXPECT_EQ(loom::files::cannot_write(dir + "/kept.json"), "");
  EXPECT_EQ(content(dir + "/kept.json.tmp"), "an earlier writer's");
  EXPECT_NE(loom::files::cannot_write(dir + "/missing/x.json").find("cannot create"), std::string::npos);
  EXPECT_EQ(loom::files::cannot_write(dir), "it is a directory");
  fs::create_symlink("target.json", dir + "/link.json");  // dangling: names a file to create
  {
    loom::files::WholeFile file(dir + "/link.json");
    std::ofstream(file.path(), file.mode()) << "through the link";
    ASSERT_TRUE(file.commit());
  }
  EXPECT_TRUE(fs::is_symlink(dir + "/link.json")) << "the link was replaced by a file";
  EXPECT_EQ(content(dir + "/target.json"), "through the link");
  fs::remove_all(dir);
}

// A slot's path rewritten by another thread while a signal handler reads it must not
// be unlinked half old and half new: that names some other file. The writer here lists
// and forgets two names in turn while remove_temporaries() runs over and over; every
// file named by a mix of the two (a torn read) must survive.
TEST(Temporaries, AHandlerNeverRemovesAPathBeingRewritten) {
  const std::string dir = loom::testing::scratch_dir("temporaries_torn");
  constexpr int kLength = 200;
  const std::string a(kLength, 'a'), b(kLength, 'b');
  std::vector<std::string> torn;
  for (int k = 1; k < kLength; ++k) {
    torn.push_back(dir + "/" + b.substr(0, k) + a.substr(k));
    torn.push_back(dir + "/" + a.substr(0, k) + b.substr(k));
  }
  for (const std::string& path : torn) std::ofstream(path) << "a user's file";
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    while (!stop.load()) {
      loom::files::add_temporary(dir + "/" + a);
      loom::files::forget_temporary(dir + "/" + a);
      loom::files::add_temporary(dir + "/" + b);
      loom::files::forget_temporary(dir + "/" + b);
    }
  });
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  while (std::chrono::steady_clock::now() < until) loom::files::remove_temporaries();
  stop.store(true);
  writer.join();
  int removed = 0;
  for (const std::string& path : torn) removed += fs::exists(path) ? 0 : 1;
  EXPECT_EQ(removed, 0) << "files named by a half-rewritten path were removed";
  fs::remove_all(dir);
}

}  // namespace
