// The loom subcommands. Each takes the arguments after its name and returns the
// process exit code: 0 success, 1 the request could not be satisfied, 2 usage error.
#pragma once

namespace loom::cli {
int cmd_run(int argc, char** argv);
int cmd_validate(int argc, char** argv);
int cmd_plugins(int argc, char** argv);
int cmd_plugins_test(int argc, char** argv);  // loom plugins test (argv[0] = "test")
int cmd_groups(int argc, char** argv);
int cmd_schedule(int argc, char** argv);
int cmd_optimizer_layout(int argc, char** argv);
int cmd_plan(int argc, char** argv);
int cmd_preprocess(int argc, char** argv);
int cmd_tokenize(int argc, char** argv);
int cmd_tokenizer_train(int argc, char** argv);
int cmd_export(int argc, char** argv);
int cmd_import(int argc, char** argv);
int cmd_generate(int argc, char** argv);
int cmd_serve(int argc, char** argv);
int cmd_eval(int argc, char** argv);
int cmd_inspect(int argc, char** argv);
}  // namespace loom::cli
